"""The training objective: mask, labels, weights, and training == inference for an anchor."""

import math

import pytest
import torch

from dflashkit.drafter import ContextCache, config_for_target, init_drafter
from dflashkit.objective import (anchor_candidates, block_attention_mask, build_blocks,
                                 dflash_loss, expected_acceptance_length, sample_anchors)
from tests.conftest import MASK, VOCAB, tiny_target

B = 6
GAMMA = 4.0


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("qwen3", seed=4)
    drafter = init_drafter(config_for_target(target, num_layers=2, block_size=B, mask_token_id=MASK,
                                             target_layer_ids=[0, 2, 3]), seed=1)
    torch.manual_seed(0)
    L = 40
    ids = torch.randint(3, VOCAB - 2, (1, L))
    feats = target.forward(ids, 0, None, capture=[0, 2, 3]).features
    loss_mask = torch.zeros(1, L)
    loss_mask[0, 12:] = 1
    return target, drafter, ids, feats, loss_mask


def brute_force_mask(anchors, valid, L, B):
    b, N = anchors.shape
    m = torch.zeros(b, N * B, L + N * B, dtype=torch.bool)
    for i in range(b):
        for n in range(N):
            if not valid[i, n]:
                continue
            for k in range(B):
                q = n * B + k
                for j in range(L):
                    m[i, q, j] = j < anchors[i, n]
                for n2 in range(N):
                    for k2 in range(B):
                        m[i, q, L + n2 * B + k2] = n2 == n
    return m[:, None]


def test_mask_equals_brute_force_with_overlapping_anchors_and_padding():
    g = torch.Generator().manual_seed(0)
    L = 30
    ids = torch.randint(3, 50, (2, L))
    lm = torch.ones(2, L)
    lm[:, :5] = 0
    anchors = [torch.tensor([5, 6, 7, 20]), torch.tensor([9, 10])]   # overlapping; row 2 padded
    blocks = build_blocks(ids, lm, anchors, B, MASK, GAMMA)
    got = block_attention_mask(blocks, L)
    assert torch.equal(got, brute_force_mask(blocks.anchors, blocks.valid, L, B))
    for _ in range(5):
        a = [sample_anchors(lm[0], 6, g), sample_anchors(lm[1], 3, g)]
        blocks = build_blocks(ids, lm, a, B, MASK, GAMMA)
        assert torch.equal(block_attention_mask(blocks, L), brute_force_mask(blocks.anchors, blocks.valid, L, B))


def test_labels_and_weights_match_a_naive_loop():
    L = 25
    ids = torch.arange(100, 100 + L)[None]
    lm = torch.zeros(1, L)
    lm[0, 8:22] = 1     # response ends before the sequence does
    anchors = [torch.tensor([8, 15, 20])]
    blocks = build_blocks(ids, lm, anchors, B, MASK, GAMMA)
    for n, p in enumerate([8, 15, 20]):
        for k in range(B):
            q = n * B + k
            assert blocks.positions[0, q] == p + k
            assert blocks.ids[0, q] == (ids[0, p] if k == 0 else MASK)
            in_range = p + k < L
            if in_range:
                assert blocks.labels[0, q] == ids[0, p + k]     # same position, no shift
            w = (k > 0) * in_range * (lm[0, p + k] if in_range else 0) * math.exp(-(k - 1) / GAMMA)
            assert blocks.weights[0, q].item() == pytest.approx(w)


def test_anchor_candidates_need_two_response_tokens():
    lm = torch.tensor([0, 0, 1, 1, 1, 0, 1, 0, 1, 1])
    assert anchor_candidates(lm).tolist() == [2, 3, 8]


def test_training_path_equals_inference_path(setup):
    target, drafter, ids, feats, loss_mask = setup
    L = ids.shape[1]
    anchors = [torch.tensor([12, 13, 17, 30])]   # overlapping blocks on purpose
    blocks = build_blocks(ids, loss_mask, anchors, B, MASK, GAMMA)
    with torch.no_grad():
        train_h = drafter(target.embed(blocks.ids), feats, torch.arange(L)[None], blocks.positions,
                          attn_mask=block_attention_mask(blocks, L))
        for n, p in enumerate(anchors[0].tolist()):
            block = torch.full((1, B), MASK)
            block[0, 0] = ids[0, p]
            emb = target.embed(block)
            pos = torch.arange(p, p + B)[None]
            infer_h = drafter(emb, feats[:, :p], torch.arange(p)[None], pos)
            torch.testing.assert_close(train_h[:, n * B:(n + 1) * B], infer_h, atol=2e-5, rtol=1e-4)
            # And through the incremental context cache the decoding loop uses.
            cache = ContextCache(len(drafter.layers))
            drafter(emb, feats[:, :p // 2], torch.arange(p // 2)[None], pos, cache=cache)
            cached_h = drafter(emb, feats[:, p // 2:p], torch.arange(p // 2, p)[None], pos, cache=cache)
            torch.testing.assert_close(train_h[:, n * B:(n + 1) * B], cached_h, atol=2e-5, rtol=1e-4)


def test_features_at_or_after_the_anchor_do_not_leak(setup):
    target, drafter, ids, feats, loss_mask = setup
    L = ids.shape[1]
    p = 20
    blocks = build_blocks(ids, loss_mask, [torch.tensor([14, p, 22])], B, MASK, GAMMA)
    mask = block_attention_mask(blocks, L)

    def run(f):
        with torch.no_grad():
            return drafter(target.embed(blocks.ids), f, torch.arange(L)[None], blocks.positions, attn_mask=mask)

    base = run(feats)
    after = feats.clone()
    after[:, p:] += torch.randn_like(after[:, p:]) * 5
    torch.testing.assert_close(run(after)[:, B:2 * B], base[:, B:2 * B])   # block of anchor p
    before = feats.clone()
    before[:, p - 1] += 5
    assert not torch.allclose(run(before)[:, B:2 * B], base[:, B:2 * B])


def test_padding_blocks_give_no_nan_and_no_gradient_leak(setup):
    target, drafter, ids, feats, loss_mask = setup
    drafter = drafter.train()
    ids2 = torch.cat([ids, ids.flip(1)])
    feats2 = torch.cat([feats, feats.flip(1)])
    lm2 = torch.cat([loss_mask, loss_mask])
    blocks = build_blocks(ids2, lm2, [torch.tensor([12, 20, 25]), torch.tensor([15])], B, MASK, GAMMA)
    head = target.lm_head.weight
    out = dflash_loss(drafter, target.embed, head, None, feats2, blocks)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    for name, p in drafter.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    drafter.zero_grad()
    assert out.slot_total[0] == 0 and out.slot_total[1:].sum() > 0


def test_restricted_vocabulary_loss_and_acceptance_estimate(setup):
    target, drafter, ids, feats, loss_mask = setup
    blocks = build_blocks(ids, loss_mask, [torch.tensor([12, 16])], B, MASK, GAMMA)
    vocab = torch.unique(ids)
    index = torch.full((VOCAB,), -1, dtype=torch.long)
    index[vocab] = torch.arange(vocab.numel())
    with torch.no_grad():
        full = dflash_loss(drafter, target.embed, target.lm_head.weight, None, feats, blocks)
        small = dflash_loss(drafter, target.embed, target.lm_head.weight[vocab], index, feats, blocks,
                            logits_chunk=3)
    assert small.weight_sum == pytest.approx(full.weight_sum)     # every label is in the vocabulary
    assert small.loss < full.loss                                  # fewer competitors, lower CE
    assert expected_acceptance_length(torch.tensor([0, 2, 5])) == pytest.approx(1 + 7 / 3)


def test_chunked_and_single_chunk_losses_give_the_same_gradients(setup):
    """Several chunks recompute each chunk's logits in the backward pass; one chunk runs
    plainly. Both must train identically."""
    target, drafter, ids, feats, loss_mask = setup
    drafter, feats = drafter.train(), feats.clone()     # the fixture's features are inference tensors
    blocks = build_blocks(ids, loss_mask, [torch.tensor([3, 9, 12, 16])], B, MASK, GAMMA)
    grads = []
    for chunk in (3, 1024):
        drafter.zero_grad()
        out = dflash_loss(drafter, target.embed, target.lm_head.weight, None, feats, blocks,
                          logits_chunk=chunk)
        assert out.num_queries > 3                       # chunk 3 really splits the rows
        out.loss.backward()
        grads.append((out.loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()}))
    drafter.zero_grad()
    (loss_a, ga), (loss_b, gb) = grads
    torch.testing.assert_close(loss_a, loss_b, atol=1e-6, rtol=1e-6)
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.skipif(__import__("dflashkit.trainer", fromlist=["x"])._cxx_compiler() is None,
                    reason="torch.compile on the CPU needs a C++ compiler")
def test_compiled_cross_entropy_matches_eager(setup):
    """train.compile_loss runs the head cross-entropy through torch.compile: the same loss and
    gradients up to rounding, with one chunk and with several (checkpointed) chunks."""
    target, drafter, ids, feats, loss_mask = setup
    drafter, feats = drafter.train(), feats.clone()
    blocks = build_blocks(ids, loss_mask, [torch.tensor([3, 9, 12, 16])], B, MASK, GAMMA)
    for chunk in (1024, 5):
        runs = []
        for compile_ce in (False, True):
            drafter.zero_grad()
            out = dflash_loss(drafter, target.embed, target.lm_head.weight, None, feats, blocks,
                              logits_chunk=chunk, compile_ce=compile_ce)
            out.loss.backward()
            runs.append((out.loss.detach(), out.slot_correct,
                         {n: p.grad.clone() for n, p in drafter.named_parameters()}))
        drafter.zero_grad()
        (loss_e, acc_e, g_e), (loss_c, acc_c, g_c) = runs
        torch.testing.assert_close(loss_c, loss_e, atol=1e-5, rtol=1e-5)
        assert torch.equal(acc_c, acc_e)
        for name in g_e:
            torch.testing.assert_close(g_c[name], g_e[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.skipif(not __import__("dflashkit.objective", fromlist=["x"]).flex_available(),
                    reason="flex attention not in this torch")
def test_flex_attention_path_equals_dense_mask_path(setup):
    target, drafter, ids, feats, loss_mask = setup
    ids2 = torch.cat([ids, ids.flip(1)])
    feats2 = torch.cat([feats, feats.flip(1)])
    lm2 = torch.cat([loss_mask, loss_mask])
    blocks = build_blocks(ids2, lm2, [torch.tensor([12, 13, 25]), torch.tensor([15])], B, MASK, GAMMA)
    head = target.lm_head.weight
    # torch's flex attention has no CPU backward: compare the forward (loss, accuracies) here;
    # the trainer only selects flex on a GPU.
    with torch.no_grad():
        dense = dflash_loss(drafter, target.embed, head, None, feats2, blocks, attention="sdpa")
        flex = dflash_loss(drafter, target.embed, head, None, feats2, blocks, attention="flex")
    torch.testing.assert_close(dense.loss, flex.loss, atol=1e-5, rtol=1e-5)
    assert torch.equal(dense.slot_correct, flex.slot_correct)


def test_distillation_term_is_the_soft_cross_entropy_of_a_naive_loop():
    """(1 - d) * CE(label) + d * sum_j -p_j log q_j, with p the teacher's top-k renormalised over
    the tokens the drafter can propose; a one-hot teacher on the label is plain CE."""
    from dflashkit.objective import chunked_cross_entropy, teacher_targets
    g = torch.Generator().manual_seed(0)
    n, H, V = 7, 8, 12
    hidden, head = torch.randn(n, H, generator=g), torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (n,), generator=g)
    # full-vocabulary ids 0..19; the draft vocabulary holds the even ones (row = id // 2)
    vocab_index = torch.tensor([i // 2 if i % 2 == 0 else -1 for i in range(20)])
    t_ids = torch.randint(0, 20, (n, 3), generator=g)
    t_ids[0] = torch.tensor([1, 3, 5])          # nothing usable: hard CE alone
    t_ids[1, 2] = -1                            # a missing entry
    t_logp = torch.log_softmax(torch.randn(n, 3, generator=g), -1)
    rows, p = teacher_targets(t_ids, t_logp, vocab_index)
    for d in (0.0, 0.3, 1.0):
        loss, hard, pred = chunked_cross_entropy(hidden, head, labels, chunk=3, soft_rows=rows,
                                                 soft_p=p, distill=d)
        for i in range(n):
            log_q = torch.log_softmax(hidden[i] @ head.T, -1)
            ce = -log_q[labels[i]]
            usable = [(int(t) // 2, float(lp.exp())) for t, lp in zip(t_ids[i], t_logp[i])
                      if t >= 0 and t % 2 == 0]
            if usable and d > 0:
                z = sum(w for _, w in usable)
                soft = -sum(w / z * log_q[r] for r, w in usable)
                expected = (1 - d) * ce + d * soft
            else:
                expected = ce
            assert loss[i].item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
            assert hard[i].item() == pytest.approx(ce.item(), rel=1e-5)
        assert torch.equal(pred, (hidden @ head.T).argmax(-1))
    one_hot_rows = labels[:, None].expand(n, 3)
    one_hot_p = torch.tensor([[1.0, 0.0, 0.0]]).expand(n, 3)
    loss, hard, _ = chunked_cross_entropy(hidden, head, labels, chunk=4, soft_rows=one_hot_rows,
                                          soft_p=one_hot_p, distill=0.7)
    torch.testing.assert_close(loss, hard)


def test_features_pass_stops_after_the_deepest_layer_and_equals_the_full_pass(family):
    """Target.features (training's feature pass) returns exactly what a full forward captures,
    without running the layers above the deepest captured one; later passes run them all."""
    from dflashkit.target import TargetError
    target = tiny_target(family, seed=3, layers=5)
    ids = torch.randint(3, VOCAB - 2, (2, 17), generator=torch.Generator().manual_seed(0))
    ran = []
    hooks = [layer.register_forward_pre_hook(lambda m, i, j=j: ran.append(j))
             for j, layer in enumerate(target.layers)]
    try:
        for layer_ids in ([0, 2], [3, 1], [4]):
            ran.clear()
            full = target.forward(ids, 0, None, capture=layer_ids).features
            assert ran == [0, 1, 2, 3, 4]
            ran.clear()
            early = target.features(ids, layer_ids)
            assert ran == list(range(max(layer_ids) + 1))
            assert torch.equal(early, full)
        ran.clear()
        out = target.forward(ids, 0, None)   # the stop is gone: logits as before
        assert ran == [0, 1, 2, 3, 4] and out.logits.shape == (2, 17, VOCAB)
    finally:
        for h in hooks:
            h.remove()
    with pytest.raises(TargetError, match="at least one target layer"):
        target.features(ids, [])
    with pytest.raises(TargetError, match="layer"):
        target.features(ids, [7])
