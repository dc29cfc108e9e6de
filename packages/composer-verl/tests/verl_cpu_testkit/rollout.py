"""TEST-ONLY: a Hugging Face ``transformers`` rollout for verl 0.9.1 on CPU (stand-in for vLLM/SGLang).

* :class:`HFGenerateReplica` (verl's ``RolloutReplica``, registered with ``RolloutReplicaRegistry``): in hybrid
  mode it starts one :class:`HFGenerateServer` Ray actor per replica (no accelerator, 0 CPUs reserved).
* :class:`HFGenerateServer`: token-in/token-out ``generate`` (verl's ``TokenOutput``): samples token by token
  from ``softmax(logits / T)`` (top-k/top-p off), returns the sampled tokens and their log-probs under that
  distribution, i.e. exactly what verl's actor computes for ``old_log_probs``.
* :class:`HFGenerateAdapter` (verl's ``BaseRollout``, the worker-side ``ServerAdapter``): ``update_weights``
  ships the trainer's full tensors to the server actor, which loads them (``strict=True``).
"""

from __future__ import annotations

import asyncio
import os
import zlib
from collections import Counter
from typing import Any

import ray
import torch

SERVER_NAME = "hf_generate_server_{rank}"


def _load_model(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


class HFGenerateServer:
    """Ray actor: the model replica that samples responses."""

    def __init__(self, model_path: str, response_length: int, eos_token_id: int | None) -> None:
        torch.set_num_threads(1)
        self.model = _load_model(model_path)
        self.response_length = response_length
        self.eos_token_id = eos_token_id if eos_token_id is not None else self.model.config.eos_token_id
        self.lock = asyncio.Lock()
        self.weight_version = 0
        self._draws: Counter[tuple[int, ...]] = Counter()  # samples drawn per prompt, for the seeds
        self.global_steps = 0  # the trainer step of the loaded weights (verl's staleness tags); 0 = initial

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def load_weights(
        self, named: list[tuple[str, torch.Tensor]], global_steps: int | None = None
    ) -> int:
        async with self.lock:
            state = dict(named)
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            real_missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
            if real_missing or unexpected:
                raise RuntimeError(f"weight sync: missing {real_missing}, unexpected {unexpected}")
            self.weight_version += 1
            if global_steps is not None:
                self.global_steps = global_steps
            return len(state)

    @torch.no_grad()
    def _sample(self, prompt_ids: list[int], params: dict[str, Any]) -> tuple[list[int], list[float]]:
        temperature = float(params.get("temperature", 1.0))
        max_tokens = int(params.get("max_tokens") or params.get("max_new_tokens") or self.response_length)
        max_tokens = min(max_tokens, self.response_length)
        # the seed: the prompt, the weights and how many samples of this prompt were drawn before (not the random
        # request id, nor Python's salted hash): a run samples the same completions whatever the request order
        key = tuple(prompt_ids)
        self._draws[key] += 1
        seed = zlib.crc32(repr((key, self.weight_version, self._draws[key])).encode())
        gen = torch.Generator().manual_seed(seed)
        ids = torch.tensor([prompt_ids])
        out = self.model(input_ids=ids, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
        tokens: list[int] = []
        logps: list[float] = []
        for _ in range(max_tokens):
            if temperature > 0:
                logp = torch.log_softmax(logits.float() / temperature, dim=-1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
            else:
                logp = torch.log_softmax(logits.float(), dim=-1)
                tok = int(logp.argmax(-1))
            tokens.append(tok)
            logps.append(float(logp[0, tok]))
            if tok == self.eos_token_id:
                break
            out = self.model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1]
        return tokens, logps

    async def generate(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str, **_: Any
    ) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        async with self.lock:
            tokens, logps = self._sample(list(prompt_ids), dict(sampling_params))
        # like verl's vLLM/SGLang servers: the weights' step goes back with every output (the v1 trainer reads it
        # as min/max_global_steps for its staleness metrics)
        return TokenOutput(
            token_ids=tokens,
            log_probs=logps,
            stop_reason="completed",
            extra_fields={"global_steps": self.global_steps},
        )

    async def wake_up(self, *_: Any, **__: Any) -> None:
        return None

    async def sleep(self, *_: Any, **__: Any) -> None:
        return None

    async def abort_all_requests(self, *_: Any, **__: Any) -> dict[str, Any]:
        return {}

    async def resume_generation(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def wait_for_requests_to_drain(self) -> None:
        async with self.lock:
            return None

    async def start_profile(self, **_: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


def _replica_cls() -> type:
    from verl.workers.rollout.replica import RolloutReplica

    class HFGenerateReplica(RolloutReplica):  # type: ignore[misc]
        async def launch_servers(self) -> None:
            model_path = getattr(self.model_config, "local_path", None) or self.model_config.path
            tok = getattr(self.model_config, "tokenizer", None)
            eos = getattr(tok, "eos_token_id", None)
            server = (
                ray.remote(HFGenerateServer)
                .options(name=SERVER_NAME.format(rank=self.replica_rank), num_cpus=0, max_concurrency=64)
                .remote(model_path, int(self.config.response_length), eos)
            )
            await server.wake_up.remote()
            self.servers = [server]
            self._server_handle = server
            self._server_address = f"hf-generate-{self.replica_rank}:0"

        async def sleep(self) -> None:
            await asyncio.gather(*[s.sleep.remote() for s in self.servers])

    return HFGenerateReplica


def _adapter_cls() -> type:
    from verl.workers.rollout.base import BaseRollout

    class HFGenerateAdapter(BaseRollout):  # type: ignore[misc]
        def __init__(
            self, config: Any, model_config: Any, device_mesh: Any, *args: Any, **kwargs: Any
        ) -> None:
            super().__init__(config, model_config, device_mesh)
            self.replica_rank = 0
            self.is_leader_rank = int(os.environ.get("RANK", "0")) == 0
            self.sleep_level = 2

        async def resume(self, tags: list[str]) -> None:
            return None

        async def release(self) -> None:
            return None

        async def update_weights(self, weights: Any, **kwargs: Any) -> None:
            named = [(name, t.detach().to("cpu", torch.float32).clone()) for name, t in weights]
            if not self.is_leader_rank:
                return
            server = ray.get_actor(SERVER_NAME.format(rank=self.replica_rank))
            await server.load_weights.remote(named, kwargs.get("global_steps"))

    return HFGenerateAdapter


def register_rollout(name: str) -> None:
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(name, _replica_cls)
    base._ROLLOUT_REGISTRY[(name, "async")] = "verl_cpu_testkit.rollout_adapter.HFGenerateAdapter"
