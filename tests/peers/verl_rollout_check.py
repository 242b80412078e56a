"""The verl recipe of docs/recipes.md against verl's own rollout server, on CPU.

Run by hand, not by the suite (verl and the vLLM engine venv pin transformers apart; see
scripts/verl-venv.sh), from the repository root::

    PYTHONPATH="$PWD" VLLM_CPU_KVCACHE_SPACE=1 "$(bash scripts/verl-venv.sh | tail -n 1)" tests/peers/verl_rollout_check.py

The recipe's two server-side blocks, as written, become the module ``my_rollout`` (the runnable
file's classes, then the verl block, which imports ``LoraSyncRollout`` from it): verl's
``vLLMHttpServer`` subclassed as ``LoraSyncServer`` with the combined worker extension. The server
runs as a Ray actor in verl's STANDALONE mode with the base weights read from disk (the HYBRID
mode's sleep/wake and base-weight sync need CUDA). Three versions are published through the
actor's ``lorasync_publish``, and verl's own ``generate()`` must return exactly the PEFT model's
greedy tokens for each. Not run: verl's trainer, ``LoraSyncReplica.launch_servers`` (it needs
verl's worker group) and the trainer-side block.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "docs"))
from _blocks import blocks_of  # noqa: E402


def write_my_rollout(folder: Path) -> None:
    """``my_rollout.py``: the recipe's runnable file, then its verl block, both verbatim."""
    page = blocks_of(REPO / "docs" / "recipes.md")
    runnable = next(b for b in page if b.marker("file") == "/tmp/verl_rollout.py")
    verl = next(b for b in page[page.index(runnable) :] if "class LoraSyncServer" in b.code)
    (folder / "my_rollout.py").write_text(runnable.code + "\n\n" + verl.code)


def main() -> None:
    import ray
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.rollout.replica import RolloutMode, RolloutReplicaRegistry

    from lorasync import Probe
    from lorasync.exporters import fsdp
    from lorasync.testing import make_peft_model, make_tiny_model, randomize_lora

    folder = Path(tempfile.mkdtemp(prefix="verl-check-"))
    write_my_rollout(folder)
    sys.path.insert(0, str(folder))
    import my_rollout

    assert RolloutReplicaRegistry.get("vllm") is my_rollout.LoraSyncReplica
    model_dir = folder / "tiny"
    make_tiny_model(model_dir)
    # The vLLM workers the actor starts import my_rollout (the worker extension) and lorasync.
    path = os.pathsep.join([str(folder), str(REPO), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path, "VLLM_CPU_KVCACHE_SPACE": "1"}})
    try:
        rollout = RolloutConfig(
            name="vllm", tensor_model_parallel_size=1, n_gpus_per_node=1, nnodes=1, dtype="float32", enforce_eager=True,
            max_model_len=256, prompt_length=64, response_length=16, load_format="auto", enable_sleep_mode=False,
            max_num_seqs=8, max_num_batched_tokens=256, engine_kwargs={"vllm": {"max_cpu_loras": 2}},
        )
        Server = ray.remote(num_cpus=1)(my_rollout.LoraSyncServer)
        server = Server.remote(
            config=rollout, model_config=HFModelConfig(path=str(model_dir), lora_rank=8, lora_alpha=16),
            rollout_mode=RolloutMode.STANDALONE, workers=[], replica_rank=0, node_rank=0, gpus_per_node=1, nnodes=1,
            cuda_visible_devices="",
        )
        ray.get(server.launch_server.remote())
        policy = make_peft_model(make_tiny_model(), r=8)
        prompt, greedy = [5, 6, 7, 8], {"temperature": 0.0, "max_tokens": 6}
        print("base model:", ray.get(server.generate.remote(prompt, dict(greedy), "base")).token_ids)
        for step in range(1, 4):
            randomize_lora(policy, seed=step)
            served = ray.get(server.lorasync_publish.remote(fsdp.export(policy), step))
            tokens = ray.get(server.generate.remote(prompt, dict(greedy), f"rollout-{step}")).token_ids
            expected = list(Probe.from_model(policy, prompt, max_tokens=6).expected_ids)
            print(f"step {step}: {served}: verl generate() {tokens}, PEFT {expected}")
            assert tokens == expected, (served, tokens, expected)
        print("OK: verl's own generate() sampled each published version exactly")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
