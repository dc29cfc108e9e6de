"""collate_sdpo: completion columns line up for student and hinted teacher (torch only)."""

import pytest
import torch
from composer_core.traces.records import TraceRecord
from composer_core.traces.sdpo_batch import collate_sdpo


def rec(i: int, prompt: list[int], hint: list[int], completion: list[int], mask: list[int]) -> TraceRecord:
    msgs = [{"role": "user", "content": "x"}]
    return TraceRecord(
        id=f"e{i}@1",
        episode_id=f"e{i}",
        turn=1,
        prompt=msgs,
        completion=[{"role": "assistant", "content": "y"}],
        teacher_prompt=[{"role": "user", "content": "h"}, *msgs],
        hint="h",
        hint_index=0,
        tokenizer="tok",
        prompt_ids=prompt,
        teacher_prompt_ids=hint + prompt,
        completion_ids=completion,
        sdpo_mask=mask,
    )


RECORDS = [
    rec(0, [5, 6, 7], [90, 91], [10, 11], [1, 1]),
    rec(1, [8], [92, 93, 94, 95], [12, 13, 14, 15], [0, 1, 1, 0]),
    rec(2, [20, 21, 22, 23, 24], [96], [16], [1]),
]


def oracle_logits(input_ids: torch.Tensor, vocab: int = 128) -> torch.Tensor:
    """A 'model' whose logits at column j put all mass on the token at column j + 1."""
    nxt = torch.roll(input_ids, shifts=-1, dims=1)
    return torch.nn.functional.one_hot(nxt, vocab).float()


def test_completion_columns_line_up() -> None:
    b = collate_sdpo(RECORDS, pad_token_id=0, tokenizer="tok")
    assert (
        b.prompt_ids.shape == (3, 5)
        and b.teacher_prompt_ids.shape == (3, 6)
        and b.completion_ids.shape == (3, 4)
    )
    assert b.prompt_ids[1].tolist() == [0, 0, 0, 0, 8] and b.prompt_mask[1].tolist() == [0, 0, 0, 0, 1]
    assert b.completion_ids[2].tolist() == [16, 0, 0, 0] and b.completion_mask[2].tolist() == [1, 0, 0, 0]
    assert b.sdpo_mask.dtype == torch.bool and b.sdpo_mask[1].tolist() == [False, True, True, False]
    assert b.sdpo_mask[0].tolist() == [True, True, False, False]  # padding never distilled
    for inputs in (b.student_inputs(), b.teacher_inputs()):
        preds = oracle_logits(inputs.input_ids)[:, inputs.logits_slice].argmax(-1)
        assert preds.shape == b.completion_ids.shape
        assert torch.equal(preds[b.completion_mask.bool()], b.completion_ids[b.completion_mask.bool()])
        # positions restart at 0 after left padding
        first = inputs.attention_mask.argmax(dim=1)
        assert all(inputs.position_ids[i, first[i]] == 0 for i in range(3))
        assert torch.equal(inputs.position_ids[1, -4:], inputs.position_ids[1, -5] + torch.arange(1, 5))


def test_collate_errors() -> None:
    with pytest.raises(ValueError, match="empty"):
        collate_sdpo([], 0)
    with pytest.raises(ValueError, match="expected one tokenizer 'other'"):
        collate_sdpo(RECORDS, 0, tokenizer="other")
    mixed = [RECORDS[0], TraceRecord(**{**RECORDS[1].to_dict(), "tokenizer": "tok2"})]
    with pytest.raises(ValueError, match="expected one tokenizer"):
        collate_sdpo(mixed, 0)
    bare = TraceRecord(
        **{**RECORDS[0].to_dict(), "prompt_ids": None, "completion_ids": None, "sdpo_mask": None}
    )
    with pytest.raises(ValueError, match="no SDPO token columns"):
        collate_sdpo([bare], 0)
