"""End to end: traces -> teacher replay (real 127.0.0.1 server) -> records -> padded batches -> a small
randomly initialised Qwen2 -> composer_core.compose_loss, with the closed-form check values of
loss-math.md (DPO at policy = reference: ln 2; SDPO with student = teacher: 0)."""

import json
import math
from pathlib import Path

import pytest
import torch
from composer_core import ComposerBatch, compose_loss
from composer_core.traces.hints import error_text_hint, render_plain
from composer_core.traces.pair_batch import collate_pairs, sequence_logps
from composer_core.traces.records import read_records, write_records
from composer_core.traces.replay import Replayer, TeacherConfig
from composer_core.traces.replay_cli import build_records
from composer_core.traces.schema import Episode, Message, ToolCall
from composer_core.traces.sdpo_batch import collate_sdpo
from composer_testkit.teacher_server import ChatServer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def episodes() -> list[Episode]:
    out = []
    for i, task in enumerate(["fix the add test", "make the parser accept empty input", "speed up io"]):
        out.append(
            Episode(
                f"ep{i}",
                (
                    Message("system", "You are a coding agent."),
                    Message("user", task),
                    Message(
                        "assistant",
                        None,
                        (ToolCall(f"c{i}", "bash", json.dumps({"cmd": f"pytest -k t{i}"})),),
                    ),
                    Message("tool", f"===== {i + 1} failed in 0.0{i}s =====", tool_call_id=f"c{i}"),
                    Message("assistant", f"I could not fix {task}."),
                ),
            )
        )
    return out


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([render_plain(e.messages) for e in episodes()] * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def test_traces_to_compose_loss(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    with ChatServer() as srv:
        teachers = [TeacherConfig(n, srv.base_url, f"model-{n}") for n in ("a", "b")]
        res = build_records(
            episodes(),
            Replayer(teachers, tmp_path / "cache"),
            hint_source=error_text_hint(),
            tokenizer=tokenizer,
            tokenizer_name="toy",
            progress=False,
        )
    write_records(res.records, tmp_path / "r.jsonl")
    records = read_records(tmp_path / "r.jsonl")
    sdpo = [r for r in records if r.has_sdpo]
    pairs = [r for r in records if r.has_pair]
    assert len(sdpo) == 3 and len(pairs) == 6  # 3 faulty turns; the two teachers agree at all 6 states

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    model = Qwen2ForCausalLM(cfg)  # float32: float64 eager attention overflows its additive mask to NaN

    def forward(inputs):
        return model(**inputs.forward_kwargs()).logits[:, inputs.logits_slice]

    sb = collate_sdpo(sdpo, pad_token_id=tokenizer.pad_token_id, tokenizer="toy")
    student_logits = forward(sb.student_inputs())
    with torch.no_grad():
        teacher_logits = forward(sb.teacher_inputs())
    logprobs = torch.log_softmax(student_logits, -1).gather(-1, sb.completion_ids.unsqueeze(-1)).squeeze(-1)

    pb = collate_pairs(pairs, tokenizer)
    chosen_logps = sequence_logps(forward(pb.chosen_inputs()), pb.chosen_ids, pb.chosen_mask)
    rejected_logps = sequence_logps(forward(pb.rejected_inputs()), pb.rejected_ids, pb.rejected_mask)
    # summed log-probs equal an unpadded per-row computation
    ids = pb.prompt_ids[1][pb.prompt_mask[1].bool()].tolist()
    assert tokenizer.decode(ids).endswith(
        "<|im_start|>assistant\n"
    ) and "<tool_call>bash" in tokenizer.decode(ids)
    c_ids = pb.chosen_ids[1, : int(pb.chosen_lengths[1])].tolist()
    with torch.no_grad():
        full = model(input_ids=torch.tensor([ids + c_ids])).logits[0, len(ids) - 1 : -1]
    ref = torch.log_softmax(full, -1).gather(-1, torch.tensor(c_ids).unsqueeze(-1)).sum()
    torch.testing.assert_close(chosen_logps[1].detach(), ref, atol=1e-3, rtol=1e-5)

    base = dict(
        logprobs=logprobs,
        advantages=torch.zeros(len(sdpo)),
        completion_mask=sb.completion_mask.bool(),
        sdpo_mask=sb.sdpo_mask,
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        ref_chosen_logps=chosen_logps.detach(),
        ref_rejected_logps=rejected_logps.detach(),
        chosen_lengths=pb.chosen_lengths,
        rejected_lengths=pb.rejected_lengths,
    )
    # student == teacher (no hint): distillation 0; policy == reference: DPO ln 2
    same = compose_loss(
        ComposerBatch(**base, student_logits=student_logits, teacher_logits=student_logits.detach()),
        alpha_sdpo=1.0,
        beta_replay=1.0,
    )
    assert same.metrics["loss/sdpo"] == pytest.approx(0.0, abs=1e-6)
    assert same.metrics["loss/replay"] == pytest.approx(math.log(2), abs=1e-6)
    assert same.metrics["replay/pairs"] == 6 and same.metrics["sdpo/tokens"] == float(sb.sdpo_mask.sum())
    # the hinted teacher differs: a positive distillation loss with finite gradients into the model
    hinted = compose_loss(
        ComposerBatch(**base, student_logits=student_logits, teacher_logits=teacher_logits),
        alpha_sdpo=1.0,
        beta_replay=1.0,
    )
    assert hinted.metrics["loss/sdpo"] > 1e-6
    model.zero_grad()
    hinted.total.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
