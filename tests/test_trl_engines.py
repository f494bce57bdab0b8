"""loopkit's TRL loops under the sharding engines and with loopkit's own keyword arguments.

Engines: on 2 CPU processes (gloo, forked ranks with torchrun's environment), `SFTLoop`, `DPOLoop` (an explicit
reference model, which TRL prepares with `prepare_fsdp` / `prepare_deepspeed`), `RewardLoop` and `GRPOLoop`
(generation on the engine's model, a reference model) under FSDP2 (`fsdp="full_shard"`,
`fsdp_config={"version": 2}`) and under DeepSpeed ZeRO-2, each against TRL's own trainer under the same engine, in
the same processes: every key TRL logs within 1e-5 relative, GRPO's rollouts equal, and the final (gathered)
weights within 1e-5. One launch per engine runs all four pairs; this file is that launch's script too
(`python tests/test_trl_engines.py OUT ENGINE [sft,dpo,reward,grpo]` under a 2-process launch; ENGINE: fsdp, zero2,
or zero3, which the test does not run: docs/trl.md, "Engines").

TRL's trainers are `Trainer`s, which do not run these engines on CPU processes as they stand (Accelerate 1.15 drops
FSDP on MULTI_CPU, and hands DeepSpeed no gloo backend): TRL's side here is set up as a GPU launch would set it up,
with the same two steps loopkit's setup stage takes (`loopkit.distributed.shard_on_cpu_processes`; a gloo process
state before the arguments, `use_configured_state`, as tests/scripts/deepspeed_child.py does for HF Trainer).

loopkit's own keywords (`storage=`, stage swaps, `metrics=`, `observers=`) on each TRL loop: passed beside TRL's
arguments, shown by `help()`, and taking effect (a DCP checkpoint resumed exactly, a swapped stage run).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)
sys.path.insert(0, os.path.join(TESTS, "scripts"))

RTOL = 1e-5
ENGINES = ("fsdp", "zero2")  # FSDP2; DeepSpeed ZeRO-2
TRAINERS = ("sft", "dpo", "reward", "grpo")
STEPS = {"sft": 3, "dpo": 3, "reward": 3, "grpo": 2}


# ---------------------------------------------------------------------------------------------------------------
# The launch (each rank): TRL's trainer, then loopkit's, for SFT, DPO and reward modelling under one engine
# ---------------------------------------------------------------------------------------------------------------
def engine_fields(engine: str) -> dict:
    if engine == "fsdp":
        return dict(fsdp="full_shard", fsdp_config={"version": 2})
    from deepspeed_child import deepspeed_config

    # use_cpu=True turns DeepSpeed off in Accelerate; use_configured_state keeps the gloo state made before
    return dict(deepspeed=deepspeed_config(engine), use_cpu=False,
                accelerator_config={"use_configured_state": True})


def on_cpu_processes(trainer_class, engine: str):
    """TRL's trainer class, set up as on GPU processes (module docstring)."""

    class OnCPUProcesses(trainer_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            assert self.is_fsdp_enabled if engine == "fsdp" else self.is_deepspeed_enabled

        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            if engine == "fsdp":
                from accelerate.utils import FullyShardedDataParallelPlugin

                from loopkit.distributed import shard_on_cpu_processes

                plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
                shard_on_cpu_processes(self.accelerator, {"fsdp_plugin": plugin}, ["FSDP"])
                self.is_fsdp_enabled = True

    OnCPUProcesses.__name__ = trainer_class.__name__
    return OnCPUProcesses


def gloo_state_for(engine: str) -> None:
    """Before a TRL trainer's arguments: a fresh Accelerate state (a process keeps its first one), with gloo for
    DeepSpeed (deepspeed_child.trainer_process_state)."""
    from accelerate.state import AcceleratorState

    if engine != "fsdp":
        from deepspeed_child import trainer_process_state

        trainer_process_state()
    else:
        AcceleratorState._reset_state(reset_partial_state=False)


def train_sft(trainer_class, folder: str, fields: dict):
    from test_trl_sft import chat_tokenizer, reviews, sft_config

    from helpers import tiny_llama

    tokenizer = chat_tokenizer()
    trainer = trainer_class(model=tiny_llama(0, vocab_size=len(tokenizer)), args=sft_config(folder, **fields),
                            train_dataset=reviews("prompt-completion", 16), processing_class=tokenizer)
    trainer.train()
    return trainer


def train_dpo(trainer_class, folder: str, fields: dict):
    from test_trl_dpo import review_pairs, train

    return train(trainer_class, folder, review_pairs(12), "explicit", **fields)


def train_reward(trainer_class, folder: str, fields: dict):
    import trl_reward_child

    return trl_reward_child.train(trainer_class, folder, trl_reward_child.preference_pairs(12), **fields)


def train_grpo(trainer_class, folder: str, fields: dict):
    """GRPO at its smallest (test_trl_grpo's setup): 2 prompts x 2 generations of up to 8 tokens per step over the
    2 ranks, two rule rewards, beta > 0 (a reference model, which TRL prepares for the engine). The reward calls'
    record (prompts, completions, rewards) is kept on the trainer as `rollout_record`."""
    import test_trl_grpo as grpo
    from accelerate import PartialState

    model_path = f"{folder}-base"  # TRL loads the reference model from a path
    state = PartialState(cpu=True)  # the process group (cpu=True: without it, no GPU means one process per rank)
    if state.is_main_process:
        grpo.base_model(model_path)
    state.wait_for_everyone()
    record = []
    trainer = trainer_class(model=model_path, reward_funcs=grpo.rewards(record), train_dataset=grpo.prompts(4),
                            processing_class=grpo.tokenizer(), args=grpo.config(folder, beta=0.04, **fields))
    trainer.train()
    trainer.rollout_record = record
    return trainer


RUNS = {"sft": ("SFTTrainer", "SFTLoop", train_sft), "dpo": ("DPOTrainer", "DPOLoop", train_dpo),
        "reward": ("RewardTrainer", "RewardLoop", train_reward), "grpo": ("GRPOTrainer", "GRPOLoop", train_grpo)}


def whole_weights(trainer) -> dict:
    """The trained model, whole, on every rank (FSDP2's DTensor shards or ZeRO-3's partitions gathered: a
    collective)."""
    import contextlib

    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    gathered = contextlib.nullcontext()
    if trainer.is_deepspeed_enabled:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(list(model.parameters()))
    with gathered:
        return {name: (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().cpu().clone()
                .contiguous() for name, tensor in model.state_dict().items()}


def engine_evidence(trainer) -> dict:
    """What ran: the distributed type, the process count, FSDP2's sharded weights or DeepSpeed's ZeRO stage."""
    from torch.distributed.tensor import DTensor

    accelerator = trainer.accelerator
    model = accelerator.unwrap_model(trainer.model_wrapped)
    weight = next(model.parameters())
    evidence = {"distributed_type": str(accelerator.distributed_type), "processes": accelerator.num_processes,
                "sharded_weight": isinstance(weight, DTensor)}
    if trainer.is_deepspeed_enabled:
        evidence["zero_stage"] = trainer.model_wrapped.zero_optimization_stage()
    ref_model = getattr(trainer, "ref_model", None)
    if ref_model is not None:
        evidence["reference"] = type(ref_model).__name__
        evidence["reference_sharded"] = isinstance(next(ref_model.parameters()), DTensor)
    return evidence


def launch_main(out: str, engine: str, kinds: tuple = TRAINERS) -> None:
    import trl
    from safetensors.torch import save_file

    import loopkit.trl

    rank = int(os.environ["RANK"])
    for kind in kinds:
        trl_name, loop_name, train = RUNS[kind]
        for name, cls in ((trl_name, on_cpu_processes(getattr(trl, trl_name), engine)),
                          (loop_name, getattr(loopkit.trl, loop_name))):
            gloo_state_for(engine)
            trainer = train(cls, os.path.join(out, name), dict(max_steps=STEPS[kind], per_device_train_batch_size=2,
                                                               **engine_fields(engine)))
            weights = whole_weights(trainer)
            if rank == 0:
                save_file(weights, os.path.join(out, f"{name}.safetensors"))
            with open(os.path.join(out, f"{name}_rank{rank}.json"), "w") as f:
                json.dump({"logs": trainer.state.log_history, "rollouts": getattr(trainer, "rollout_record", None),
                           **engine_evidence(trainer)}, f)
            trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    launch_main(sys.argv[1], sys.argv[2], *([tuple(sys.argv[3].split(","))] if len(sys.argv) > 3 else []))


# ---------------------------------------------------------------------------------------------------------------
# The tests (pytest)
# ---------------------------------------------------------------------------------------------------------------
import pytest  # noqa: E402

pytest.importorskip("trl")

from helpers import IGNORE_PIN_MEMORY_WARNING, minilm_tokenizer, tiny_llama  # noqa: E402
from loopkit.storage import DCPStorage  # noqa: E402
from loopkit.trl import DPOLoop, GRPOLoop, RewardLoop, SFTLoop  # noqa: E402
from loopkit.trl.base import LOOP_KEYWORDS  # noqa: E402

pytestmark = [IGNORE_PIN_MEMORY_WARNING, pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

def worst_log_difference(ours: list[dict], theirs: list[dict], what: str) -> float:
    """Every entry and key of `theirs` in `ours` within RTOL relative (timings aside: GRPO's `step_time` too)."""
    from test_trl_sft import compare_logs

    def untimed(entries):
        return [{key: value for key, value in entry.items() if key != "step_time"} for entry in entries]

    return compare_logs(untimed(ours), untimed(theirs), what)


# -- the engines ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory, forked):
    """{engine: folder of its launch}: both launches at once (4 ranks), forked from the session's fork server."""
    from test_deepspeed import build_comm_op, deepspeed_env
    from test_distributed import child_env

    from helpers import wait_for

    build_comm_op()  # DeepSpeed's shared-memory op, built or loaded once before two ranks race for it
    folders = {engine: tmp_path_factory.mktemp(engine) for engine in ENGINES}
    environments = {"fsdp": child_env(cpu_mode=True), "zero2": deepspeed_env()}
    launches = {engine: forked.launch([os.path.abspath(__file__), folders[engine], engine], 2,
                                      f"the 2-process {engine} launch", env=environments[engine])
                for engine in ENGINES}
    for engine, launch in launches.items():
        output = wait_for(launch, f"the 2-process {engine} launch")
        assert launch.returncode == 0, f"{engine} launch failed:\n{output[-8000:]}"
    return folders


ENGINE_EVIDENCE = {"fsdp": {"distributed_type": "DistributedType.FSDP", "processes": 2, "sharded_weight": True},
                   "zero2": {"distributed_type": "DistributedType.DEEPSPEED", "processes": 2,
                                 "sharded_weight": False, "zero_stage": 2}}
WITH_REFERENCE = ("dpo", "grpo")  # DPO's explicit reference model; GRPO's, loaded by TRL as beta > 0
REFERENCE_EVIDENCE = {"fsdp": {"reference": "FSDPLlamaForCausalLM", "reference_sharded": True},
                      "zero2": {"reference": "DeepSpeedEngine", "reference_sharded": False}}


@pytest.mark.parametrize("engine", ENGINES)
def test_trl_loops_equal_trls_trainers_under_the_same_engine(engine, engine_runs):
    """SFT (prompt-completion), DPO (sigmoid, an explicit reference model that TRL shards or wraps for the engine)
    and reward modelling, 3 steps of 2 ranks x 2 samples, and GRPO (`model.generate` on the sharded or wrapped
    policy, two rule rewards, a reference model as beta > 0), 2 steps of 2 ranks x 2 completions: loopkit's loop
    and TRL's trainer ran under the engine (the evidence), GRPO's rollouts are equal on each rank, and every logged
    key of both ranks and the final weights agree within 1e-5."""
    from safetensors.torch import load_file
    from test_trl_sft import compare_weights

    folder = engine_runs[engine]
    rollouts = {}
    for kind in TRAINERS:
        trl_name, loop_name, _ = RUNS[kind]
        for rank in (0, 1):
            theirs, ours = (json.load(open(os.path.join(folder, f"{name}_rank{rank}.json")))
                            for name in (trl_name, loop_name))
            expected = {**ENGINE_EVIDENCE[engine], **(REFERENCE_EVIDENCE[engine] if kind in WITH_REFERENCE else {})}
            for evidence in (theirs, ours):
                assert {key: evidence.get(key) for key in expected} == expected, (kind, rank, evidence)
            if kind == "grpo":  # each rank's prompts, completions and rewards, reward call by reward call
                assert len(theirs["rollouts"]) == 2 * STEPS[kind] and ours["rollouts"] == theirs["rollouts"]
                rollouts[rank] = theirs["rollouts"]
            steps = [entry for entry in theirs["logs"] if "loss" in entry]
            assert len(steps) == STEPS[kind] and len({entry["loss"] for entry in steps}) == STEPS[kind]  # it trained
            assert all(entry["grad_norm"] > 0 for entry in steps)
            worst = worst_log_difference(ours["logs"], theirs["logs"], f"{engine} {kind} rank {rank}")
        weights = compare_weights(load_file(os.path.join(folder, f"{loop_name}.safetensors")),
                                  load_file(os.path.join(folder, f"{trl_name}.safetensors")), kind)
        print(f"\n{engine} {kind}: {len(theirs['logs'][0])} keys logged; largest relative difference: logs "
              f"{worst:.3g}, weights {weights:.3g}")
    assert rollouts[0] != rollouts[1]  # each rank generated for its own prompts


# -- loopkit's own keywords ----------------------------------------------------------------------------------
TRL_LOOPS = (SFTLoop, DPOLoop, RewardLoop, GRPOLoop)


@pytest.mark.parametrize("loop_class", TRL_LOOPS, ids=lambda cls: cls.__name__)
def test_signature_shows_trls_arguments_and_loopkits_and_refuses_an_unknown_keyword(loop_class):
    import inspect
    import pydoc

    from loopkit.trl.base import trl_trainer_class

    trainer_class = trl_trainer_class(loop_class)
    trl_names = list(inspect.signature(trainer_class.__init__).parameters)[1:]
    parameters = inspect.signature(loop_class).parameters
    assert list(parameters) == trl_names + list(LOOP_KEYWORDS)
    assert all(parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in LOOP_KEYWORDS)
    shown = pydoc.render_doc(loop_class, renderer=pydoc.plaintext)
    assert "processing_class" in shown and "storage=None" in shown and "observers=None" in shown
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'storag'.*did you mean storage\?"):
        loop_class(model=None, storag=DCPStorage())
    with pytest.raises(TypeError, match=r"'peft_confg'.*did you mean peft_config\?"):
        loop_class(model=None, peft_confg=None)


def test_a_subclass_with_its_own_init_shows_its_own_signature_and_passes_loopkits_keywords_on():
    import inspect

    class Tagged(RewardLoop):
        def __init__(self, model, tag: str, **kwargs):
            self.tag = tag
            super().__init__(model, **kwargs)

    assert list(inspect.signature(Tagged).parameters) == ["model", "tag", "kwargs"]
    with pytest.raises(TypeError, match=r"'storag'.*did you mean storage\?"):
        Tagged(None, "x", storag=None)


def test_a_dpo_loop_with_its_own_loss_names_the_nearest_keyword_too(tmp_path):
    """DPOLoop reads the config before TRL's preparation when its step brings its own loss: a misspelt keyword is
    still refused naming the nearest, and loopkit's own are no TRL argument to it."""
    from test_trl_dpo import dpo_config

    from loopkit.trl.dpo import DPOStep

    class OwnLoss(DPOStep):
        def preference_loss(self, pairs):
            return -torch.nn.functional.logsigmoid(pairs.chosen_logratios - pairs.rejected_logratios)

    with pytest.raises(TypeError, match=r"'storag'.*did you mean storage\?"):
        DPOLoop(model=None, args=dpo_config(tmp_path), step=OwnLoss(), storag=DCPStorage())
    with pytest.raises(TypeError, match=r"'ref_modle'.*did you mean ref_model\?"):
        DPOLoop(model=None, args=dpo_config(tmp_path), step=OwnLoss(), storage=DCPStorage(), ref_modle=None)


def resumed_like_uninterrupted(build, folder: str, save_at: int = 2) -> tuple:
    """`build(output_dir)` trained uninterrupted (a checkpoint at `save_at`), then a fresh `build` resumed from that
    checkpoint: (uninterrupted, resumed, checkpoint folder). The resumed run's logs after the checkpoint and its
    final weights must equal the uninterrupted run's."""
    uninterrupted = build(os.path.join(folder, "whole"))
    uninterrupted.train()
    checkpoint = os.path.join(folder, "whole", f"checkpoint-{save_at}")
    resumed = build(os.path.join(folder, "resumed"))
    resumed.train(resume_from_checkpoint=checkpoint)
    def steps_after(loop):  # the step logs (the summary's train_loss averages this train() only, as in Trainer)
        return [entry for entry in loop.state.log_history if entry["step"] > save_at and "loss" in entry]

    assert steps_after(uninterrupted)
    worst_log_difference(steps_after(resumed), steps_after(uninterrupted), "resumed")
    for name, tensor in uninterrupted.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name
    return uninterrupted, resumed, checkpoint


def assert_dcp_checkpoint(loop, checkpoint: str) -> None:
    """Written by the DCPStorage passed in (torch.distributed.checkpoint's folder), not by the default storage."""
    assert isinstance(loop.context.checkpointer.format, DCPStorage)  # the policy holds the storage passed in
    assert DCPStorage().recognises(checkpoint) and not os.path.exists(os.path.join(checkpoint, "model.safetensors"))


def test_sft_loop_with_a_dcp_storage_resumes_exactly(tmp_path):
    from test_trl_sft import chat_tokenizer, reviews, sft_config

    def build(output_dir):
        tokenizer = chat_tokenizer()
        return SFTLoop(model=tiny_llama(0, vocab_size=len(tokenizer)), processing_class=tokenizer,
                       args=sft_config(output_dir, save_strategy="steps", save_steps=2),
                       train_dataset=reviews("prompt-completion", 16), storage=DCPStorage())

    uninterrupted, resumed, checkpoint = resumed_like_uninterrupted(build, str(tmp_path))
    assert_dcp_checkpoint(resumed, checkpoint)


def test_dpo_loop_with_a_dcp_storage_resumes_exactly(tmp_path):
    from test_trl_dpo import dpo_config, review_pairs, tokenizer

    def build(output_dir):
        tok = tokenizer()
        return DPOLoop(model=tiny_llama(0, len(tok)), ref_model=tiny_llama(0, len(tok)), processing_class=tok,
                       args=dpo_config(output_dir, save_strategy="steps", save_steps=2),
                       train_dataset=review_pairs(16), storage=DCPStorage())

    _, resumed, checkpoint = resumed_like_uninterrupted(build, str(tmp_path))
    assert_dcp_checkpoint(resumed, checkpoint)


def test_grpo_loop_with_a_dcp_storage_resumes_exactly(tmp_path):
    from test_trl_grpo import config, prompts, rewards, tokenizer

    model_path = str(tmp_path / "tiny-llama")
    tiny_llama(vocab_size=len(minilm_tokenizer())).save_pretrained(model_path)

    def build(output_dir):
        return GRPOLoop(model=model_path, reward_funcs=rewards([]), train_dataset=prompts(),
                        processing_class=tokenizer(), storage=DCPStorage(),
                        args=config(output_dir, max_steps=3, save_strategy="steps", save_steps=2))

    _, resumed, checkpoint = resumed_like_uninterrupted(build, str(tmp_path))
    assert_dcp_checkpoint(resumed, checkpoint)


def test_reward_loop_with_an_observer_and_a_swapped_step_stage(tmp_path):
    """`observers=` adds its key to every training log; `step=` is the step stage that runs (RewardTrainer's forward
    handed to it, as to the default one)."""
    import trl_reward_child

    from loopkit.observers import StepObserver
    from trl import RewardTrainer

    from loopkit.trl.reward import RewardStep

    class WindowsSeen(StepObserver):
        def __init__(self):
            self.windows = 0

        def on_step(self, result, window, state):
            self.windows += 1

        def logs(self, state):
            return {"windows_seen": self.windows}

    class CountedClipping(RewardStep):
        clipped = 0

        def clip_gradients(self, model):
            self.clipped += 1
            return super().clip_gradients(model)

    tokenizer = trl_reward_child.reward_tokenizer()
    step = CountedClipping()
    loop = RewardLoop(model=trl_reward_child.reward_model(tokenizer), processing_class=tokenizer,
                      args=trl_reward_child.reward_config(str(tmp_path), max_steps=3),
                      train_dataset=trl_reward_child.preference_pairs(12), observers=[WindowsSeen()], step=step)
    loop.train()
    assert loop.step is step and step.clipped == 3
    assert step.trl_loss.__func__ is RewardTrainer.compute_loss  # RewardTrainer's forward, on the stage given
    steps = [entry for entry in loop.state.log_history if "loss" in entry]
    assert [entry["windows_seen"] for entry in steps] == [1, 2, 3] and "accuracy" in steps[0]
