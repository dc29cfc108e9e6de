"""The tiny Qwen2 and character tokenizer (hf extra) agree with the task's pure-Python ids."""

from __future__ import annotations

import torch
from composer_core.tasks import digit_reversal as T
from composer_core.tasks.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model, build_tiny_qwen2


def test_char_tokenizer_uses_the_task_ids(tmp_path) -> None:
    from transformers import AutoTokenizer

    tok = build_char_tokenizer(T.ALPHABET)
    assert tok.get_vocab() == T.VOCAB
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    assert tok.padding_side == "left"
    text = ".8.|381>"
    assert tok(text, add_special_tokens=True)["input_ids"] == T.encode(text)
    completion = [*T.encode("183"), tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(completion, skip_special_tokens=True) == T.decode(completion) == "183"
    tok.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path)(text)["input_ids"] == T.encode(text)


def test_tiny_model_is_seeded_and_leaves_the_global_rng_alone() -> None:
    tok = build_char_tokenizer(T.ALPHABET)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = build_tiny_model(tok, seed=0)
    assert torch.equal(torch.random.get_rng_state(), before)
    b = build_tiny_qwen2(len(T.VOCAB), seed=0)
    c = build_tiny_qwen2(len(T.VOCAB), seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert a.config.vocab_size == 16 and a.config.eos_token_id == 1 and a.config.pad_token_id == 0
    eager = build_tiny_qwen2(16, TinyModelConfig(hidden_size=32, attn_implementation="eager"))
    assert eager.config.hidden_size == 32 and eager.config._attn_implementation == "eager"
    logits = a(input_ids=torch.tensor([T.encode("381>")])).logits
    assert logits.shape == (1, 4, 16)


def test_tiny_moe_model() -> None:
    import pytest

    cfg = TinyModelConfig(hidden_size=32, intermediate_size=64, num_experts=4, num_experts_per_tok=2)
    moe = build_tiny_qwen2(16, cfg, seed=0)
    again = build_tiny_qwen2(16, cfg, seed=0)
    assert type(moe).__name__ == "Qwen2MoeForCausalLM"
    assert moe.config.num_experts == 4 and moe.config.num_experts_per_tok == 2
    assert moe.config.router_aux_loss_coef > 0  # transformers' default: GRPOTrainer adds the aux loss
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in moe.state_dict().items())
    gates = [n for n, _ in moe.named_parameters() if n.endswith("mlp.gate.weight")]
    assert len(gates) == 2  # every layer sparse
    out = moe(input_ids=torch.tensor([T.encode("381>")]), output_router_logits=True)
    assert out.logits.shape == (1, 4, 16) and out.aux_loss is not None
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        TinyModelConfig(num_experts=2, num_experts_per_tok=3)


def test_chatml_tokenizer_reloads_as_qwen2_with_the_same_ids(tmp_path) -> None:
    """``chatml=True``: a qwen2 model directory's tokenizer reloads (as transformers' Qwen2Tokenizer) with the
    task's ids, ``"\\n"`` one token, the ChatML specials, and no extra id beyond the model's vocabulary."""
    from composer_core.tasks.tiny import CHATML_TEMPLATE, IM_END, IM_START
    from transformers import AutoTokenizer

    tok = build_char_tokenizer(T.ALPHABET, chatml=True)
    assert tok.chat_template == CHATML_TEMPLATE
    assert tok("381>", add_special_tokens=False)["input_ids"] == T.encode("381>")  # the task's ids stay
    build_tiny_model(tok).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert type(again).__name__ == "Qwen2Tokenizer"
    assert again.get_vocab() == tok.get_vocab() and len(again) == len(tok)
    assert len(again.encode("\n", add_special_tokens=False)) == 1
    ids = again.apply_chat_template([{"role": "user", "content": "381>"}], add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert again.decode(ids) == f"{IM_START}user\n381>{IM_END}\n{IM_START}assistant\n"
    assert ids[0] == again.convert_tokens_to_ids(IM_START) and IM_END in again.all_special_tokens
