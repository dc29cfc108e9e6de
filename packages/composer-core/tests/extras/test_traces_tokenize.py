"""SDPO masks line up with the student's completion tokens (locally trained tokenizer, with and without
a chat template); hinted and plain token sequences differ only by the hint; Parquet records."""

import json
from pathlib import Path

import pytest
from composer_core.traces import replay_cli
from composer_core.traces.hints import (
    build_hinted_context,
    error_text_hint,
    hint_token_span,
    render_plain,
    tokenize_hinted,
)
from composer_core.traces.records import read_records, write_records
from composer_core.traces.replay_cli import build_records
from composer_core.traces.schema import Episode, Message, ToolCall, find_error_sites, write_openai_jsonl
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ARGS = '{"cmd": "pytest tests/test_math.py -x"}'


def episode() -> Episode:
    return Episode(
        "e1",
        (
            Message("system", "You are a careful coding agent."),
            Message("user", "Make the failing math test pass."),
            Message("assistant", "Let me run the tests.", (ToolCall("c1", "bash", ARGS),)),
            Message("tool", "===== 1 failed, 4 passed in 0.03s =====\nexit code: 1", tool_call_id="c1"),
            Message("assistant", "The add function is wrong; fixing it."),
        ),
    )


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        render_plain(episode().messages),
        "pytest tests failed passed exit code hint assistant user",
    ] * 20
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=SPECIAL,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


@pytest.fixture
def chat_tokenizer(tokenizer: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    tokenizer.chat_template = CHATML
    yield tokenizer
    tokenizer.chat_template = None


def ctx():
    ep = episode()
    return build_hinted_context(ep, find_error_sites(ep)[0], error_text_hint())


def char_spans(tokenizer, ids: list[int]) -> list[tuple[int, int]]:
    """Independent offsets: lengths of decoded growing prefixes."""
    spans, prev = [], 0
    for k in range(len(ids)):
        end = len(tokenizer.decode(ids[: k + 1]))
        spans.append((prev, end))
        prev = end
    return spans


class SlowLike:
    """A tokenizer that, like a slow HF tokenizer, cannot return offsets."""

    def __init__(self, inner: PreTrainedTokenizerFast) -> None:
        self.inner = inner
        self.chat_template = inner.chat_template

    def __call__(self, text: str, **kw):
        if kw.pop("return_offsets_mapping", False):
            raise NotImplementedError("return_offset_mapping is not available when using Python tokenizers")
        return self.inner(text, **kw)

    def decode(self, ids):
        return self.inner.decode(ids)

    def apply_chat_template(self, *a, **kw):
        return self.inner.apply_chat_template(*a, **kw)


def test_plain_mask_covers_exactly_the_completion_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenizer.chat_template is None
    c = ctx()
    t = tokenize_hinted(c, tokenizer)
    assert t.prompt_text == render_plain(c.prompt, add_generation_prompt=True)
    assert t.completion_text == f"Let me run the tests.\n<|tool_call|>bash {ARGS}\n<|end|>\n"
    assert t.completion_ids == tokenizer(t.completion_text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(t.completion_ids) == t.completion_text  # lossless: the ids are the completion
    assert tokenizer.decode(t.prompt_ids) == t.prompt_text
    assert len(t.sdpo_mask) == len(t.completion_ids) and all(t.sdpo_mask)
    a, b = hint_token_span(t.prompt_ids, t.teacher_prompt_ids)
    assert t.teacher_prompt_ids[:a] + t.teacher_prompt_ids[b:] == t.prompt_ids
    assert tokenizer.decode(t.teacher_prompt_ids) == t.teacher_prompt_text
    cut = len(render_plain(c.prompt[: c.hint_index]))
    assert (
        t.teacher_prompt_text
        == t.prompt_text[:cut] + render_plain([Message("user", c.hint)]) + t.prompt_text[cut:]
    )
    # the inserted token run holds the hint (its ends may shift by a repeated boundary token such as "<|")
    assert c.hint in tokenizer.decode(t.teacher_prompt_ids[max(0, a - 3) : b + 3])


@pytest.mark.parametrize("slow", [False, True])
def test_span_mask_lines_up_with_token_offsets(tokenizer: PreTrainedTokenizerFast, slow: bool) -> None:
    tok = SlowLike(tokenizer) if slow else tokenizer
    t = tokenize_hinted(ctx(), tok, mask_text=ARGS)
    start = t.completion_text.index(ARGS)
    end = start + len(ARGS)
    spans = char_spans(tokenizer, t.completion_ids)
    expected = [int(s < end and start < e) for s, e in spans]
    assert t.sdpo_mask == expected
    assert 0 < sum(t.sdpo_mask) < len(t.sdpo_mask)
    masked = [i for i, m in enumerate(t.sdpo_mask) if m]
    assert masked == list(range(masked[0], masked[-1] + 1))  # one contiguous run
    covered = tokenizer.decode(t.completion_ids[masked[0] : masked[-1] + 1])
    assert ARGS in covered and len(covered) < len(ARGS) + 8  # no more than the boundary tokens
    with pytest.raises(ValueError, match="does not occur"):
        tokenize_hinted(ctx(), tok, mask_text="not in there")
    with pytest.raises(ValueError, match="outside the completion"):
        tokenize_hinted(ctx(), tok, mask_spans=[(0, 10_000)])


def test_chat_template_mask_and_hint(chat_tokenizer: PreTrainedTokenizerFast) -> None:
    c = ctx()
    t = tokenize_hinted(c, chat_tokenizer)
    assert t.prompt_text.endswith("<|im_start|>assistant\n")
    assert t.completion_text == f"Let me run the tests.<tool_call>bash {ARGS}</tool_call><|im_end|>\n"
    im_end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in t.completion_ids  # the student generates the end-of-turn token: it is distilled too
    assert chat_tokenizer.decode(t.prompt_ids + t.completion_ids) == chat_tokenizer.apply_chat_template(
        [
            m.to_api_dict()
            | (
                {"tool_calls": [{"function": {"name": "bash", "arguments": json.loads(ARGS)}}]}
                if m.tool_calls
                else {}
            )
            for m in (*c.prompt, c.completion)
        ],
        tokenize=False,
    )
    assert len(t.sdpo_mask) == len(t.completion_ids) and all(t.sdpo_mask)
    a, b = hint_token_span(t.prompt_ids, t.teacher_prompt_ids)
    assert t.teacher_prompt_ids[:a] + t.teacher_prompt_ids[b:] == t.prompt_ids
    # the run is found as far right as the repeated boundary token allows: shift it left by one
    assert (
        chat_tokenizer.decode(t.teacher_prompt_ids[a - 1 : b - 1])
        == f"<|im_start|>user\n{c.hint}<|im_end|>\n"
    )
    assert t.teacher_prompt_ids[: a - 1] + t.teacher_prompt_ids[b - 1 :] == t.prompt_ids
    # span mask through the template rendering
    ts = tokenize_hinted(c, chat_tokenizer, mask_text=ARGS)
    spans = char_spans(chat_tokenizer, ts.completion_ids)
    s0 = ts.completion_text.index(ARGS)
    assert ts.sdpo_mask == [int(s < s0 + len(ARGS) and s0 < e) for s, e in spans]
    # forcing the plain rendering on a template tokenizer also works and differs
    plain = tokenize_hinted(c, chat_tokenizer, chat_template=False)
    assert plain.completion_ids != t.completion_ids


def test_template_errors(tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError, match="has no chat_template"):
        tokenize_hinted(ctx(), tokenizer, chat_template=True)
    tokenizer.chat_template = (
        "{% for m in messages[-1:] %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"
    )
    try:
        with pytest.raises(ValueError, match="rewrites earlier turns"):
            tokenize_hinted(ctx(), tokenizer)
    finally:
        tokenizer.chat_template = None


def test_pipeline_records_with_tokens_and_parquet(
    chat_tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    res = build_records(
        [episode()], None, hint_source=error_text_hint(), tokenizer=chat_tokenizer, tokenizer_name="toy"
    )
    (rec,) = res.records
    assert rec.has_sdpo and not rec.has_pair and rec.tokenizer == "toy"
    assert rec.sdpo_mask == [1] * len(rec.completion_ids)
    for suffix in ("jsonl", "parquet"):
        p = tmp_path / f"r.{suffix}"
        write_records(res.records, p)
        assert read_records(p) == res.records
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "r.parquet")
    import pyarrow as pa

    assert pa.types.is_list(table.schema.field("sdpo_mask").type)
    assert table.schema.field("sdpo_mask").type.value_type == pa.int64()
    assert table.schema.field("prompt").type == pa.string()  # message columns are JSON text


def test_cli_with_local_tokenizer_dir(chat_tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    chat_tokenizer.save_pretrained(tmp_path / "tok")
    traces = tmp_path / "t.jsonl"
    write_openai_jsonl([episode()], traces)
    out = tmp_path / "o.parquet"
    # in-process (a subprocess would re-import transformers: slow on CI); the subprocess CLI is covered
    # by the replay tests
    argv = ["--traces", str(traces), "--out", str(out), "--tokenizer", str(tmp_path / "tok"), "--no-progress"]
    assert replay_cli.main(argv) == 0
    (rec,) = read_records(out)
    t = tokenize_hinted(ctx(), chat_tokenizer)
    assert (rec.prompt_ids, rec.completion_ids, rec.teacher_prompt_ids, rec.sdpo_mask) == (
        t.prompt_ids,
        t.completion_ids,
        t.teacher_prompt_ids,
        t.sdpo_mask,
    )


def test_padded_batch_logits_match_unpadded_rows(chat_tokenizer: PreTrainedTokenizerFast) -> None:
    """A real (tiny, randomly initialised) Qwen2: the logits collate_sdpo points at are the ones that
    predict each completion token, for the student and the hinted teacher, despite padding."""
    import torch
    from composer_core.traces.sdpo_batch import collate_sdpo
    from transformers import Qwen2Config, Qwen2ForCausalLM

    eps = []
    for i, extra in enumerate(["", " Please hurry, the release is today.", " x" * 12]):
        base = episode()
        msgs = (base.messages[0], Message("user", base.messages[1].content + extra), *base.messages[2:])
        eps.append(Episode(f"e{i}", msgs))
    res = build_records(
        eps, None, hint_source=error_text_hint(), tokenizer=chat_tokenizer, tokenizer_name="toy"
    )
    batch = collate_sdpo(res.records, pad_token_id=chat_tokenizer.pad_token_id, tokenizer="toy")
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(chat_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for inputs, prompts in (
            (batch.student_inputs(), [r.prompt_ids for r in res.records]),
            (batch.teacher_inputs(), [r.teacher_prompt_ids for r in res.records]),
        ):
            logits = model(
                input_ids=inputs.input_ids,
                attention_mask=inputs.attention_mask,
                position_ids=inputs.position_ids,
            ).logits[:, inputs.logits_slice]
            for i, r in enumerate(res.records):
                row = torch.tensor([prompts[i] + r.completion_ids])
                ref = model(input_ids=row).logits[0, len(prompts[i]) - 1 : -1]
                n = len(r.completion_ids)
                torch.testing.assert_close(logits[i, :n], ref, atol=1e-5, rtol=1e-5)
    assert batch.sdpo_mask.sum().item() == sum(len(r.completion_ids) for r in res.records)
