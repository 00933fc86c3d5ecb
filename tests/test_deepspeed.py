"""memopt under DeepSpeed ZeRO on 2 CPU processes (``DS_ACCELERATOR=cpu``, gloo).

One spawned 2-process run (:func:`two_ranks`, :mod:`ranks`) whose workers run every case and hand
their numbers to the tests: retained activation memory under ZeRO-3 with and without int4,
gradients under ZeRO-3 and ZeRO-2 against the same memopt config under DDP, drift checks that
must leave training untouched, and an Accelerate loop (``DeepSpeedPlugin`` + ``MemOptPlugin``)
whose ``save_state``/``load_state`` and the engine's own ``save_checkpoint`` carry memopt's bits.
ZeRO-3 is configured to partition every parameter (``stage3_param_persistence_threshold: 0``):
by default it keeps small ones whole, and this tiny model would then never be partitioned.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported anywhere
if importlib.util.find_spec("deepspeed") is None:  # not imported here: collection stays quick
    pytest.skip("the deepspeed extra is not installed", allow_module_level=True)

from ranks import run_two_ranks, tokens  # noqa: E402
from zoo import hf_llama  # noqa: E402

from memopt_plugins import MemoryOptimizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

INT4 = {"quantize": {"bits": 4, "rounding": "nearest"}}
LLAMA = {"dim": 64, "layers": 2, "seq": 32}


def ds_config(stage: int, batch: int, **zero) -> dict:
    """A ZeRO config for one CPU process per rank; stage 3 partitions every parameter."""
    if stage == 3:
        zero = {"stage3_param_persistence_threshold": 0, **zero}
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, **zero},
        "zero_allow_untested_optimizer": True,
    }


def _engine(model, stage: int, batch: int, lr: float = 0.0, **zero):
    import deepspeed

    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config(stage, batch, **zero)
    )
    return engine


def _llama(batch: int, rank: int):
    model, _, loss_fn = hf_llama(batch_size=batch, **LLAMA)
    return model, tokens(rank, batch) % 256, loss_fn


# --------------------------------------------------------------------------- one process
def _checkpointed(kind: str):
    """HF Llama whose layers run under a checkpoint of ``kind``, with int8 nearest memopt."""
    import deepspeed

    functions = {
        "none": None,
        "deepspeed": deepspeed.checkpointing.checkpoint,
        "deepspeed non-reentrant": deepspeed.checkpointing.non_reentrant_checkpoint,
    }
    model, batch, loss_fn = hf_llama(batch_size=4, **LLAMA)
    if functions[kind] is not None:
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=functions[kind])
    model.train()
    opt = MemoryOptimizer({"quantize": {"bits": 8, "rounding": "nearest"}})
    opt.apply(model)
    return model, batch, loss_fn, opt


def test_deepspeed_checkpoint_regions_keep_only_their_inputs():
    """``deepspeed.checkpointing`` owns its regions as torch's checkpoint does: memopt pushes no
    hooks inside (the non-reentrant form would otherwise hand memopt the region's tensors, which
    it would compress, and recompute nothing). Both forms then compress the same few tensors
    outside the regions, far fewer than the model without checkpoints, to the same gradients."""
    runs = {}
    for kind in ("none", "deepspeed", "deepspeed non-reentrant"):
        model, batch, loss_fn, opt = _checkpointed(kind)
        loss_fn(model, batch).backward()
        stats = opt.internal.compression.stats
        runs[kind] = (stats.forward_tensors, stats.forward_original, model)
    plain, reentrant, non_reentrant = runs.values()
    assert reentrant[:2] == non_reentrant[:2]
    assert reentrant[0] < plain[0] / 4 and reentrant[1] < plain[1] / 4
    pairs = zip(non_reentrant[2].named_parameters(), reentrant[2].parameters(), strict=True)
    for (name, p), q in pairs:
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("kind", ["deepspeed", "deepspeed non-reentrant"])
def test_a_drift_check_through_deepspeed_checkpointing_says_why_it_cannot_run(kind):
    model, batch, loss_fn, opt = _checkpointed(kind)
    with pytest.raises(RuntimeError, match="torch.autograd.grad.*deepspeed.checkpointing"):
        opt.check_drift(loss_fn, batch=batch[:2])


# --------------------------------------------------------------------------- worker cases
def _memory(rank: int) -> dict[str, int]:
    """Retained bytes of a forward per rank under ZeRO-3 (max of RSS and memopt's packed bytes,
    as tests/test_fsdp.py reads them), without memopt and at int4; measured first, while the
    spawned process is fresh."""
    from memopt_plugins.profiler.meter import MemoryMeter

    out = {}
    for name, config in (("zero3", None), ("int4", INT4)):
        model, batch, loss_fn = _llama(16, rank)
        opt = MemoryOptimizer(config) if config else None
        if opt is not None:
            opt.apply(model)
        engine = _engine(model, 3, 16)
        engine.backward(loss_fn(engine, batch))  # gradient partitions and buffers exist first
        meter = MemoryMeter("cpu")
        stats = opt.internal.compression.stats if opt is not None else None
        step = functools.partial(loss_fn, engine, batch)
        readings = [meter.measure(step, stats, backward=False) for _ in range(2)]
        out[name] = min(max(r.retained, r.packed) for r in readings)
        out[name + " packed"] = min(r.packed for r in readings)
        engine.destroy()
    return out


def _full_grads(engine) -> list[torch.Tensor]:
    from deepspeed.utils import safe_get_full_grad

    return [safe_get_full_grad(p).clone() for p in engine.module.parameters()]


@contextmanager
def _torch_linear():
    """``F.linear`` as torch has it: the first ZeRO-3 engine replaces it for the whole process
    with DeepSpeed's ``zero3_linear_wrap`` (which saves the weight parameter itself, where torch's
    saves a view ``weight.t()`` of the gathered weight), and ``memory_efficient_linear: false``
    does not put it back."""
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    functional = torch.nn.functional
    current = functional.linear
    functional.linear = getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", current)
    try:
        yield
    finally:
        functional.linear = current


def _ddp_grads(rank: int, config) -> list[torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel

    model, batch, loss_fn = _llama(8, rank)
    if config is not None:
        MemoryOptimizer(config).apply(model)
    ddp = DistributedDataParallel(model)
    loss_fn(ddp, batch).backward()
    return [p.grad.clone() for p in model.parameters()]


def _gradients(rank: int) -> dict:
    """One step's full gradients (averaged over ranks) under ZeRO-3 (both linear forms) and
    ZeRO-2 with int4, against int4 and exact under DDP."""
    with _torch_linear():
        out = {"ddp": _ddp_grads(rank, None), "ddp int4": _ddp_grads(rank, INT4)}
    runs = {
        "zero3 int4": (3, {}, nullcontext()),
        "zero3 int4 torch linear": (3, {"memory_efficient_linear": False}, _torch_linear()),
        "zero2 int4": (2, {}, nullcontext()),
    }
    for name, (stage, zero, linear) in runs.items():
        model, batch, loss_fn = _llama(8, rank)
        opt = MemoryOptimizer(INT4)
        opt.apply(model)
        with linear:
            engine = _engine(model, stage, 8, **zero)
            engine.backward(loss_fn(engine, batch))
            out[name] = _full_grads(engine)
        out[name + " saves"] = opt.internal.compression.stats.forward_tensors
        engine.destroy()
    return out


def _train(rank: int, config, check_every: int | None, steps: int = 3) -> dict:
    """``steps`` ZeRO-3 steps; with ``check_every`` a drift check after each backward, as the
    Accelerate plugin runs it (on the engine's module)."""
    model, batch, loss_fn = _llama(8, rank)
    opt = MemoryOptimizer(config)
    opt.apply(model)
    engine = _engine(model, 3, 8, lr=0.1)
    losses, reports = [], []
    for step in range(steps):
        loss = loss_fn(engine, batch)
        engine.backward(loss)
        if check_every is not None:
            report = opt.check_drift(loss_fn, batch=batch[:4], step=step, if_due=True)
            reports.append(None if report is None else (report.max, dict(report.escalated)))
        engine.step()
        opt.count_step()
        losses.append(loss.item())
    from deepspeed.utils import safe_get_full_fp32_param

    params = [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]
    engine.destroy()
    return {"losses": losses, "params": params, "reports": reports, "bits": opt.bits}


def _drift(rank: int) -> dict:
    """Checks every step at threshold 1.0 (nothing escalates) against no checks; and from 2 bits
    with a check every step (escalates)."""
    checked = {**INT4, "drift": {"threshold": 1.0, "check_every": 1}}
    two_bits = {"quantize": {"bits": 2}, "drift": {"check_every": 1}}
    return {
        "int4": _train(rank, INT4, None),
        "int4 checked": _train(rank, checked, 1),
        "2 bits": _train(rank, two_bits, 1, steps=2),
    }


def _accelerate(rank: int, root: Path) -> dict:
    """``MemOptPlugin`` at int4 in an Accelerate loop over ZeRO-3 (``DeepSpeedPlugin``): drift
    checks every 2 steps at a 1% threshold (which int4 exceeds), then ``save_state`` and
    ``load_state`` into a fresh run, and the engine's own checkpoint with memopt's state in its
    ``client_state``. (Accelerate's ``backward`` also takes DeepSpeed's optimizer step, so the
    check runs on the updated weights.)"""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    from memopt_plugins.accelerate import MemOptPlugin

    config = {"quantize": {"bits": 4}, "drift": {"check_every": 2, "threshold": 0.01}}

    def prepared(plugin):
        AcceleratorState._reset_state(reset_partial_state=True)
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config(3, 4)))
        model, batch, loss_fn = _llama(4, rank)
        optimizer = torch.optim.SGD(plugin.apply(model).parameters(), lr=0.01)
        engine, optimizer = accelerator.prepare(model, optimizer)
        plugin.attach(accelerator)
        return accelerator, engine, optimizer, batch, loss_fn

    plugin = MemOptPlugin(config)
    accelerator, engine, optimizer, batch, loss_fn = prepared(plugin)
    reports = []
    for step in range(3):
        accelerator.backward(loss_fn(engine, batch))
        report = plugin.after_backward(step, loss_fn, batch)
        reports.append(None if report is None else (report.max, dict(report.escalated)))
        optimizer.step()
        optimizer.zero_grad()
    accelerator.save_state(str(root / "accelerate"))
    engine.save_checkpoint(str(root / "engine"), client_state={"memopt": plugin.state_dict()})
    saved = {
        "distributed type": str(accelerator.distributed_type),
        "engine": type(engine).__name__,
        "bits": plugin.bits,
        "reports": reports,
        "kept bytes": plugin.metrics()["memopt/kept_bytes"],
        "compression": plugin.metrics()["memopt/compression_ratio"],
    }
    engine.destroy()

    fresh = MemOptPlugin(config)
    accelerator, engine, *_ = prepared(fresh)
    accelerator.load_state(str(root / "accelerate"))
    saved["loaded bits"], saved["loaded steps"] = fresh.bits, fresh.steps
    other = MemOptPlugin(config)
    _, client = engine.load_checkpoint(str(root / "engine"))
    other.load_state_dict(client["memopt"])
    saved["engine bits"] = other.bits
    engine.destroy()
    return saved


def _applied_after_zero3(rank: int) -> dict:
    """memopt applied to a model ZeRO-3 has partitioned already (Lightning's order): int4 and
    recompute give the gradients of memopt applied first; fused chains are refused."""
    from memopt_plugins import ConfigError

    out: dict = {}
    for name, config in (("int4", INT4), ("recompute", {"recompute": {"modules": ["*.mlp"]}})):
        grads = []
        for order in ("before", "after"):
            model, batch, loss_fn = _llama(8, rank)
            opt = MemoryOptimizer(config)
            if order == "before":
                opt.apply(model)
            engine = _engine(model, 3, 8)
            if order == "after":
                opt.apply(engine.module)
            engine.backward(loss_fn(engine, batch))
            grads.append(_full_grads(engine))
            engine.destroy()
        out[name] = _rel(grads[1], grads[0])
    model, *_ = _llama(8, rank)
    engine = _engine(model, 3, 8)
    try:
        MemoryOptimizer({"ops": {"fuse": ["mlp"]}}).apply(engine.module)
    except ConfigError as err:
        out["fuse refused"] = str(err)
    engine.destroy()
    return out


def _trainer(rank: int, root: Path) -> dict:
    """``MemOptTrainerCallback`` at int4 in a ``transformers.Trainer`` with a ZeRO-3
    ``deepspeed=`` config: 4 steps, checks every 2 at a 1% threshold, a checkpoint at step 2
    (DeepSpeed's, with memopt's state in trainer_state.json), and a run resumed from it."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from memopt_plugins.transformers import MemOptTrainerCallback

    config = {"quantize": {"bits": 4}, "drift": {"check_every": 2, "threshold": 0.01}}
    ids = tokens(0, 64) % 256
    data = [{"input_ids": row, "labels": row} for row in ids]
    zero = ds_config(3, "auto")
    zero["gradient_accumulation_steps"] = "auto"

    class BitsAtStart(TrainerCallback):
        def __init__(self, memopt):
            self.memopt, self.bits = memopt, None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.bits is None:
                self.bits = self.memopt.bits

    # accelerate takes each rank of a CPU DeepSpeed run for a process of its own (index 0 of
    # 1), so both ranks' Trainers wrote the checkpoint's shared files, and trainer_state.json
    # came out torn now and then (two writes at once). In this worker (a process of the run's
    # own) rank 0 alone writes them, as on GPUs; DeepSpeed's checkpoint is every rank's, as there.
    TrainingArguments.should_save = property(lambda _: torch.distributed.get_rank() == 0)

    def fit(max_steps: int, resume: str | None = None):
        memopt = MemOptTrainerCallback(config)
        probe = BitsAtStart(memopt)
        model, _, _ = _llama(4, rank)
        args = TrainingArguments(
            output_dir=str(root / "trainer"), max_steps=max_steps, per_device_train_batch_size=4,
            learning_rate=1e-3, save_strategy="steps", save_steps=2, report_to="none",
            disable_tqdm=True, seed=0, deepspeed=zero, logging_steps=1,
        )  # fmt: skip
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[memopt, probe])
        trainer.train(resume_from_checkpoint=resume)
        rows = [r for r in trainer.state.log_history if "memopt/escalations" in r]
        return trainer, memopt, probe, rows

    trainer, memopt, _, rows = fit(4)
    out = {
        "engine": type(trainer.model_wrapped).__name__,
        "escalations": [r["memopt/escalations"] for r in rows],
        "bits": memopt.bits,
        "losses": [r["loss"] for r in trainer.state.log_history if "loss" in r],
    }
    saved = root / "trainer" / "checkpoint-2"
    _, memopt, probe, _ = fit(3, str(saved))
    out["resumed bits"] = probe.bits
    state = (saved / "trainer_state.json").read_text()
    out["saved"] = '"memopt"' in state
    return out


def _cases(out: Path) -> dict:
    os.environ["DS_ACCELERATOR"] = "cpu"
    return {
        "memory": _memory,
        "gradients": _gradients,
        "drift": _drift,
        "accelerate": functools.partial(_accelerate, root=out),
        "applied after": _applied_after_zero3,
        "trainer": functools.partial(_trainer, root=out),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """One spawned 2-process gloo run of everything below; each rank's results."""
    return run_two_ranks(_cases, tmp_path_factory.mktemp("deepspeed"), seconds=600)


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """‖a − b‖ / ‖b‖ over all gradients together."""
    num = sum(((x - y).double() ** 2).sum() for x, y in zip(a, b, strict=True))
    return float((num / sum((y.double() ** 2).sum() for y in b)).sqrt())


# --------------------------------------------------------------------------- tests
@pytest.mark.slow
def test_int4_retains_4x_less_activation_memory_per_rank_than_zero3(two_ranks):
    for r in two_ranks:
        memory = r["memory"]
        assert memory["int4 packed"] > 0
        assert memory["zero3"] / memory["int4"] >= 4.0, memory


@pytest.mark.slow
def test_gradients_under_zero_are_ddp_with_the_same_compression(two_ranks):
    """Gathered ZeRO-3 weights are parameters to memopt (never compressed): the gradients are
    those of the same int4 config under DDP to float rounding, and as far from exact as there."""
    for r in two_ranks:
        g = r["gradients"]
        codec_error = _rel(g["ddp int4"], g["ddp"])
        assert 0 < codec_error < 4.0  # int4's bound in tests/test_exactness.py
        # torch's F.linear saves views of the gathered weights, DeepSpeed's the parameters
        assert g["zero3 int4 torch linear saves"] > g["zero3 int4 saves"]
        for name in ("zero3 int4", "zero3 int4 torch linear", "zero2 int4"):
            assert _rel(g[name], g["ddp int4"]) < 1e-4, name
            assert _rel(g[name], g["ddp"]) < 1.01 * codec_error, name


@pytest.mark.slow
def test_drift_checks_that_escalate_nothing_leave_zero3_training_unchanged(two_ranks):
    for r in two_ranks:
        d = r["drift"]
        assert all(report is not None and not report[1] for report in d["int4 checked"]["reports"])
        assert d["int4 checked"]["losses"] == d["int4"]["losses"]
        pairs = zip(d["int4 checked"]["params"], d["int4"]["params"], strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)


@pytest.mark.slow
def test_drift_from_2_bits_escalates_identically_on_both_ranks(two_ranks):
    d0, d1 = (r["drift"]["2 bits"] for r in two_ranks)
    assert d0["reports"][0][1], "2 bits at the default threshold must escalate"
    assert [e for _, e in d0["reports"]] == [e for _, e in d1["reports"]]
    assert d0["bits"] == d1["bits"] and max(d0["bits"].values()) > 2


@pytest.mark.slow
def test_accelerate_zero3_checks_alike_and_state_round_trips(two_ranks):
    a0, a1 = (r["accelerate"] for r in two_ranks)
    assert a0["distributed type"] == "DistributedType.DEEPSPEED"
    assert a0["engine"] == "DeepSpeedEngine"
    assert a0["reports"] == a1["reports"]  # the drift max-reduced over ranks: one decision
    assert [r is not None for r in a0["reports"]] == [True, False, True]
    assert a0["reports"][0][1], "int4 at a 1% threshold must escalate"
    assert a0["bits"] == a1["bits"] and max(a0["bits"].values()) > 4
    assert a0["kept bytes"] > 0 and a0["compression"] > 4
    for a in (a0, a1):
        assert a["loaded bits"] == a["bits"] and a["loaded steps"] == 3
        assert a["engine bits"] == a["bits"]


@pytest.mark.slow
def test_applied_after_zero3_partitions_compression_and_recompute_work_and_fusion_is_refused(
    two_ranks,
):
    for r in two_ranks:
        after = r["applied after"]
        assert after["int4"] < 1e-6 and after["recompute"] < 1e-6
        assert "already partitioned by DeepSpeed ZeRO-3" in after["fuse refused"]


@pytest.mark.slow
def test_trainer_with_a_zero3_config_escalates_alike_and_resumes_with_the_bits(two_ranks):
    t0, t1 = (r["trainer"] for r in two_ranks)
    assert t0["engine"] == "DeepSpeedEngine"
    assert t0["bits"] == t1["bits"] and max(t0["bits"].values()) > 4
    assert max(t0["escalations"]) > 0 and t0["saved"]
    # the resumed run's first step runs at the bits of the checkpoint (the checks that raised
    # them were at step 0, the checkpoint at step 2)
    assert t0["resumed bits"] == t1["resumed bits"] == t0["bits"]
