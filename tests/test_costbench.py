"""``dflashkit bench-cost`` on a tiny model: the floors' arithmetic and the written report."""

import json

import pytest
import torch
from torch import nn

from dflashkit.costbench import run_cost_bench
from dflashkit.costs import drafter_pass_floor, pass_flops, pass_weight_bytes
from dflashkit.decoding import DFlashProposer
from dflashkit.drafter import config_for_target, init_drafter
from tests.conftest import MASK, tiny_target


class _Tiny(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head


def test_weight_bytes_count_the_head_once_and_skip_the_input_embedding():
    body = (4 * 4 + 4) * 4
    assert pass_weight_bytes(_Tiny(tied=False)) == body + 10 * 4 * 4
    assert pass_weight_bytes(_Tiny(tied=True)) == body + 10 * 4 * 4     # the tied matrix, read as the head


def test_floors_and_report_of_a_tiny_model(tmp_path, monkeypatch):
    target = tiny_target("qwen2", seed=3)
    drafter = init_drafter(config_for_target(target, num_layers=1, block_size=4, mask_token_id=MASK))
    monkeypatch.setattr("dflashkit.costbench.measure_bandwidth_gbs", lambda: 10.0)   # GB/s
    monkeypatch.setattr("dflashkit.costbench.measure_matmul_gflops", lambda dtype: 100.0)
    r = run_cost_bench(target, drafter, kv_lengths=(16,), max_q=4, backends=("fast", "default"),
                       repeats=1, out=tmp_path, progress=False)
    weights = pass_weight_bytes(target.model)
    assert r["floors_ms"]["16"]["bandwidth"] == pytest.approx(weights / 10e9 * 1000)
    assert r["floors_ms"]["16"]["compute"][3] == pytest.approx(pass_flops(target, 3, 16) / 100e9 * 1000)
    params = weights / 4                          # fp32: every weight twice per token, plus attention
    cfg = target.config
    attn = 4 * 3 * (16 + 3) * cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert pass_flops(target, 3, 16) == pytest.approx(2 * params * 3 + attn)
    assert set(r["verify_ms"]) == {"fast", "default"} and all(
        v > 0 for b in r["verify_ms"].values() for v in b["16"].values())
    nbytes, flops = drafter_pass_floor(DFlashProposer(drafter, target), 16)
    own = sum(p.numel() for p in drafter.parameters()) + target.lm_head.weight.numel()
    assert nbytes == own * 4 and flops > 2 * own
    assert r["draft_floors_ms"]["16"]["bandwidth"] == pytest.approx(nbytes / 10e9 * 1000)
    rounds = r["verify_rounds_ms"]["fast"]["16"]
    assert set(rounds) == {1, 2, 3, 4} and all(len(v) == 1 for v in rounds.values())
    table = (tmp_path / "costs.md").read_text()
    assert "| 4 |" in table and "Drafter pass" in table and "Its floors: bandwidth" in table
    assert "fast rounds min-max ms" in table
    assert json.loads((tmp_path / "costs.json").read_text())["qs"] == [1, 2, 3, 4]
    assert (tmp_path / "costs.png").stat().st_size > 0
    r = run_cost_bench(target, None, kv_lengths=(16,), max_q=2, backends=("default",), repeats=1,
                       out=tmp_path / "d", progress=False)
    assert "default / default q=1" in (tmp_path / "d" / "costs.md").read_text()   # labels the backend run
    assert torch.get_num_threads() == r["threads"]


def test_every_round_visits_every_q_so_drift_cannot_land_on_a_few(monkeypatch):
    """Timing each q's repeats back to back let a slow stretch of a shared machine land on
    a few q (a 14-token pass read 32% dearer than a 15-token one on one EPYC)."""
    from dflashkit.costs import measure_step_verify_rounds, measure_verify_ms
    target = tiny_target("qwen2", seed=3)
    seen, forward = [], target.forward

    def recording(ids, *args, **kwargs):
        seen.append(ids.shape[1])
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(target, "forward", recording)
    times = measure_step_verify_rounds(target, [1, 2, 3], kv_length=8, rounds=2, acceptance=False)
    assert seen == [8] + [1, 2, 3] * 3          # the prompt, a warm-up round, then two rounds
    assert all(len(v) == 2 for v in times.values())
    seen.clear()
    medians = measure_verify_ms(target, [1, 2], kv_length=8, repeats=3)
    assert seen == [8] + [1, 2] * 4 and set(medians) == {1, 2}


def test_a_table_written_before_rounds_were_kept_still_renders():
    from dflashkit.costbench import cost_table
    r = {"target": "t", "dtype": "float32", "cpu": "c", "threads": 2, "torch": "x",
         "bandwidth_gbs": 10.0, "matmul_gflops": 100.0, "weight_bytes": 1e9, "qs": [1, 2],
         "kv_lengths": [256], "verify_ms": {"fast": {"256": {"1": 10.0, "2": 12.0}}},
         "draft_ms": {}, "floors_ms": {"256": {"bandwidth": 100.0, "compute": {"1": 1.0, "2": 2.0}}}}
    table = cost_table(r)
    assert "| 2 | 12.0 | 1.20x |" in table and "rounds" not in table
