"""The test kit's tiny model directory passes verl's agent-loop tokenizer checks (no Ray needed).

verl 0.9.1's agent loop loads the tokenizer from the model directory (``hf_tokenizer``: ``AutoTokenizer``, which
rebuilds a ``qwen2`` directory's tokenizer as transformers' ``Qwen2Tokenizer``) and picks its continuous-token
builder by the model type (``QwenContinuousTokenBuilder``: ``"\\n"`` must be one token, ``<|im_end|>`` must
exist). The character tokenizer without ``chatml=True`` failed here ("Expected Qwen newline to tokenize to one
token, got []"); this is the same construction, in-process.
"""

from __future__ import annotations

from composer_verl.rows import render_prompt_ids
from verl_cpu_testkit.task import build_model_dir, build_tokenizer


def test_verl_loads_the_kit_tokenizer_and_builds_the_qwen_agent_loop_prompt(tmp_path) -> None:
    from verl.utils.tokenizer.continuous_token import QwenContinuousTokenBuilder
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder
    from verl.utils.tokenizer.tokenizer import hf_tokenizer

    path = build_model_dir(tmp_path / "model")
    tok = hf_tokenizer(str(path))
    assert type(tok).__name__ == "Qwen2Tokenizer"  # the reload path of a real Qwen model directory
    assert tok.get_vocab() == build_tokenizer().get_vocab()
    builder = create_continuous_token_builder(tok, hf_model_type="qwen2")
    assert isinstance(builder, QwenContinuousTokenBuilder)
    messages = [{"role": "user", "content": "381>"}]
    ids = builder.build_initial_tokens(messages)
    assert ids == render_prompt_ids(tok, messages) == render_prompt_ids(build_tokenizer(), messages)
    assert tok.decode(ids) == "<|im_start|>user\n381><|im_end|>\n<|im_start|>assistant\n"
