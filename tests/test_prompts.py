"""Training prompts never overlap the evaluation prompts of the bench."""

from dflashkit.prompts import _conversation, _normalised, sharegpt_first_turns


def test_sharegpt_training_turns_share_no_conversation_or_text_with_the_eval_split():
    train, held = sharegpt_first_turns("train"), sharegpt_first_turns("eval")
    assert len(train) > 5000 and len(held) > 500
    held_convs = {_conversation(p["id"].removeprefix("sharegpt-")) for p in held}
    held_texts = {_normalised(p["messages"][0]["content"]) for p in held}
    assert not any(_conversation(p["id"].removeprefix("sharegpt-")) in held_convs for p in train)
    assert not any(_normalised(p["messages"][0]["content"]) in held_texts for p in train)
    assert _conversation("hRPPgZT_11") == "hRPPgZT" and _conversation("abc") == "abc"
