"""memopt under FSDP2 (``fully_shard``): compression, recompute, dropout, BatchNorm and drift.

The held-out model is Hugging Face GPT-2 with ``fully_shard`` on every block and on the root (HF
Llama where a test needs ``nn.Linear``, whose 3-D forward saves a view ``weight.t()`` of the
weight). Fast cases run FSDP2 on a single-process mesh in this process; the bar of the issue runs
in one spawned 2-process gloo run (:func:`two_ranks`), whose workers run every case of the bar,
an Accelerate loop and a Lightning ``ModelParallelStrategy`` fit, and hand their numbers to the
tests.
"""

from __future__ import annotations

import copy
import csv
import functools
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from memopt_plugins.callbacks import MemOptCallback, MemOptProfileCallback
from probes import BitsAtFirstBatch
from ranks import TIMEOUT, WORLD, local, rel, run_two_ranks, shard, tokens, train
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from zoo import hf_gpt2, hf_llama

from memopt_plugins import MemoryOptimizer
from memopt_plugins.patching import EngineHook

pytestmark = pytest.mark.usefixtures("one_thread")

INT8 = {"quantize": {"bits": 8, "rounding": "nearest"}}
TWO_BITS = {"quantize": {"bits": 2, "rounding": "nearest"}, "drift": {"check_every": 1}}


# --------------------------------------------------------------------------- one process
@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """A process group of one rank (gloo) for FSDP2 in this process."""
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=0, world_size=1, timeout=TIMEOUT
    )
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("order", ["before", "after"])
def test_unsharded_weights_and_their_views_are_never_compressed(mesh, order):
    """FSDP2 unshards a weight into fresh memory every forward; Llama's ``nn.Linear`` saves a view
    of it (``weight.t()``). Decided at pack time, neither is compressed: the step packs what the
    unsharded model packs, and the gradients are the same."""
    config = {"quantize": {"bits": 8, "rounding": "nearest", "min_numel": 512}}
    model, batch, loss_fn = hf_llama(batch_size=2, seq=16, dim=32, layers=2)
    expected = MemoryOptimizer(config)
    expected.apply(reference := copy.deepcopy(model))
    loss_fn(reference, batch).backward()

    opt = MemoryOptimizer(config)
    if order == "before":
        opt.apply(model)
    shard(model)
    if order == "after":
        opt.apply(model)
    loss_fn(model, batch).backward()
    stats, want = opt.internal.compression.stats, expected.internal.compression.stats
    assert (stats.forward_tensors, stats.forward_original) == (
        want.forward_tensors,
        want.forward_original,
    )
    grads = {n: local(p.grad) for n, p in model.named_parameters()}
    for name, p in reference.named_parameters():
        assert torch.allclose(grads[name], p.grad, rtol=1e-5, atol=1e-7), name
    opt.remove()


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("nesting", ["region in unit", "unit in region"])
def test_recompute_regions_and_fsdp_units_nest_either_way(mesh, order, nesting):
    """Recompute an MLP inside a sharded block, or a whole block whose MLP is its own FSDP unit;
    memopt applied before or after ``fully_shard``: the losses are the unsharded baseline's."""
    model, batch, loss_fn = hf_gpt2(batch_size=4, seq=32, dim=64, layers=2, dropout=0.1)
    baseline = train(copy.deepcopy(model), loss_fn, batch)
    blocks = list(model.transformer.h)
    if nesting == "region in unit":
        config, units = {"recompute": {"modules": ["*.mlp"]}}, blocks
    else:
        config, units = {"recompute": {"modules": ["transformer.h.*"]}}, [b.mlp for b in blocks]
    opt = MemoryOptimizer(config)
    if order == "before":
        opt.apply(model)
    shard(model, units)
    if order == "after":
        opt.apply(model)
    assert len(opt.plan.recomputed) == 2
    assert rel(train(model, loss_fn, batch, opt=opt), baseline) < 1e-5
    opt.remove()  # memopt's hooks go, FSDP's stay
    hooks = [
        h
        for m in model.modules()
        for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())
    ]
    assert hooks and not any(isinstance(h, EngineHook) for h in hooks)


def test_drift_on_a_one_rank_mesh_is_the_unsharded_models(mesh):
    """The check differentiates what the forward ran with (FSDP's unsharded parameters), not the
    sharded DTensors registered on the modules: the same drifts and escalations as unsharded, and
    ``.grad`` (FSDP's reduce-scattered gradient) as it was."""
    model, batch, loss_fn = hf_gpt2(batch_size=4, seq=32, dim=64, layers=2)
    plain = copy.deepcopy(model)
    expected = MemoryOptimizer(TWO_BITS)
    expected.apply(plain)
    want = expected.check_drift(lambda: loss_fn(plain, batch[:2]))

    opt = MemoryOptimizer(TWO_BITS)
    opt.apply(model)
    shard(model)
    loss_fn(model, batch).backward()
    grads = [local(p.grad) for p in model.parameters()]
    got = opt.check_drift(lambda: loss_fn(model, batch[:2]))
    assert all(
        torch.equal(g, local(p.grad)) for g, p in zip(grads, model.parameters(), strict=True)
    )
    assert got.escalated == want.escalated and got.escalated
    assert set(got.per_module) == set(want.per_module)
    for fqn, drift in want.per_module.items():
        assert got.per_module[fqn] == pytest.approx(drift, rel=1e-4), fqn
    assert opt.bits == expected.bits


def test_callback_profile_is_refused_under_model_parallel_strategy():
    """The profile runs on rank 0 alone; a sharded forward would wait for the other ranks."""
    trainer = SimpleNamespace(strategy=ModelParallelStrategy())
    profile = MemOptProfileCallback()
    with pytest.raises(MisconfigurationException, match="rank 0 alone"):
        profile.setup(trainer, ShardedGPT2(), "fit")


# --------------------------------------------------------------------------- two processes
def _memory(rank: int) -> dict[str, int]:
    """Retained bytes of a forward (per rank, max of RSS and packed bytes), FSDP2 baseline and
    int8; measured first, while the spawned process is fresh (tests/memory.py says why)."""
    from memopt_plugins.profiler.meter import MemoryMeter

    out = {}
    for name, config in (("baseline", None), ("int8", INT8)):
        model, _, loss_fn = hf_gpt2(batch_size=16, seq=32, dim=64, layers=2)
        batch = tokens(rank, 16)
        opt = MemoryOptimizer(config) if config else None
        if opt is not None:
            opt.apply(model)
        shard(model)
        loss_fn(model, batch).backward()  # gradients and FSDP's buffers exist first
        meter = MemoryMeter("cpu")
        stats = opt.internal.compression.stats if opt is not None else None
        step = functools.partial(loss_fn, model, batch)
        readings = [meter.measure(step, stats) for _ in range(2)]
        out[name] = min(max(r.retained, r.packed) for r in readings)
    return out


def _losses(rank: int) -> dict:
    """Three steps of each memopt mode, memopt applied before ``fully_shard``."""
    checked = {**INT8, "drift": {"threshold": 1.0, "check_every": 1}}
    runs = {
        "baseline": (None, 0.0),
        "recompute": ({"recompute": {"modules": ["transformer.h.*"]}}, 0.0),
        "int8": (INT8, 0.0),
        "int8 checked": (checked, 0.0),
        "dropout baseline": (None, 0.1),
        "bitmask": ({"dropout": {"mode": "bitmask"}}, 0.1),
    }
    out: dict = {}
    for name, (config, dropout) in runs.items():
        model, _, loss_fn = hf_gpt2(batch_size=8, seq=32, dim=64, layers=2, dropout=dropout)
        batch = tokens(rank)
        opt = MemoryOptimizer(config) if config else None
        if opt is not None:
            opt.apply(model)
        shard(model)
        kept: list[bool] = []
        check = None
        if name == "int8 checked":
            check = _grad_keeping_check(model, opt, loss_fn, batch, kept)
        out[name] = train(model, loss_fn, batch, opt=opt, check=check)
        out[name + " params"] = [local(p) for p in model.parameters()]
        if check is not None:
            out["grads kept"] = kept
            out["checked escalations"] = opt.state_dict()["drift"]["escalations"]
    out["bn"] = _batchnorm_and_dropout(rank)
    return out


LEAN = {"ops": {"loss": "chunked", "fuse": ["all"]}}


def _lean(rank: int) -> dict:
    """Three steps of HF Llama with every lean op (the loss head in chunks: its weight is in
    the root's FSDP unit, gathered for the chunks), plain and with int8, under ``fully_shard``
    and under DDP, beside the unpatched model."""
    from torch.nn.parallel import DistributedDataParallel

    out: dict = {}
    for engine in ("fsdp2", "ddp"):
        for name, config in (("baseline", None), ("lean", LEAN), ("lean int8", {**LEAN, **INT8})):
            model, _, loss_fn = hf_llama(batch_size=8, seq=32, dim=64, layers=2)
            batch = tokens(rank) % 256  # Llama's vocabulary
            opt = MemoryOptimizer(config) if config else None
            if opt is not None:
                opt.apply(model)
            wrapped = shard(model) if engine == "fsdp2" else DistributedDataParallel(model)
            out[f"{engine} {name}"] = train(wrapped, loss_fn, batch, opt=opt)
            if engine == "ddp":
                out[f"{engine} {name} params"] = [local(p) for p in model.parameters()]
            if opt is not None:
                out[f"{engine} {name} ops"] = sorted({p.lean for p in opt.plan.values() if p.lean})
    return out


def _grad_keeping_check(model, opt, loss_fn, batch, kept: list[bool]):
    """A drift check after each backward that notes whether the sharded ``.grad`` survived it."""

    def check(step: int) -> None:
        before = [local(p.grad) for p in model.parameters()]
        opt.check_drift(lambda: loss_fn(model, batch[:4]), step=step, if_due=True)
        after = [local(p.grad) for p in model.parameters()]
        kept.append(all(torch.equal(b, a) for b, a in zip(before, after, strict=True)))

    return check


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return self.drop(torch.relu(self.bn(self.fc(x))))


def _batchnorm_and_dropout(rank: int) -> dict:
    """BatchNorm in running mode after one warmup step and bitmask dropout, sharded, against the
    sharded baseline whose BatchNorm layers go to eval mode after that step (which running mode
    equals): losses, and each rank's running statistics (its own, as without memopt)."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(rank))

    def loss_fn(model, x):
        return model(x).square().mean()

    out = {}
    for name in ("baseline", "memopt"):
        torch.manual_seed(0)
        model = nn.Sequential(_Block(128), _Block(128), nn.Linear(128, 1))
        opt = None
        if name == "memopt":
            opt = MemoryOptimizer(
                {
                    "dropout": {"mode": "bitmask"},
                    "batchnorm": {"mode": "running", "warmup_steps": 1},
                }
            )
            opt.apply(model)
        shard(model, [model[0], model[1]])

        def to_eval(step, model=model):
            for m in model.modules():
                if isinstance(m, nn.BatchNorm1d):
                    m.eval()

        out[name] = train(model, loss_fn, x, opt=opt, check=to_eval if opt is None else None)
        out[name + " running_mean"] = model[0].bn.running_mean.clone()
    return out


def _drift(rank: int) -> dict:
    """From 2 bits with a check every step, each rank on its own data; and, on the same data on
    both ranks, the drifts against the unsharded model's."""
    model, _, loss_fn = hf_gpt2(batch_size=8, seq=32, dim=64, layers=2)
    batch = tokens(rank)
    opt = MemoryOptimizer({"quantize": {"bits": 2}, "drift": {"check_every": 1}})
    opt.apply(model)
    shard(model)
    bits, escalated = [], []

    def check(step):
        report = opt.check_drift(lambda: loss_fn(model, batch[:4]), step=step, if_due=True)
        bits.append(opt.bits)
        escalated.append(dict(report.escalated))

    train(model, loss_fn, batch, opt=opt, check=check)

    same = tokens(0)
    model, _, loss_fn = hf_gpt2(batch_size=8, seq=32, dim=64, layers=2)
    plain = copy.deepcopy(model)
    reference = MemoryOptimizer(TWO_BITS)
    reference.apply(plain)
    want = reference.check_drift(lambda: loss_fn(plain, same[:4]), max_rounds=1)
    opt = MemoryOptimizer(TWO_BITS)
    opt.apply(model)
    shard(model)
    got = opt.check_drift(lambda: loss_fn(model, same[:4]), max_rounds=1)
    return {
        "bits": bits,
        "escalated": escalated,
        "same data": (got.per_module, want.per_module),
    }


def _accelerate(rank: int, root: Path) -> dict:
    """``MemOptPlugin`` in an Accelerate loop over a model sharded with ``fully_shard``: Accelerate
    prepares FSDP2 itself only on GPUs (on the CPU it sets the FSDP plugin aside for DDP, which
    would fail on a sharded model), so it prepares the optimizer and runs the loop, the checks
    (reduced through ``accelerator.reduce``) and ``save_state``/``load_state``."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    from memopt_plugins.accelerate import MemOptPlugin

    config = {"quantize": {"bits": 2}, "drift": {"check_every": 2}}
    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    plugin = MemOptPlugin(config)
    model, _, loss_fn = hf_gpt2(batch_size=4, seq=32, dim=32, layers=1)
    batch = tokens(rank, 4)
    shard(plugin.apply(model))
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.01))
    plugin.attach(accelerator)
    for step in range(3):
        accelerator.backward(loss_fn(model, batch))
        sample = plugin.sample(batch)
        plugin.after_backward(step, lambda s=sample: loss_fn(model, s))
        optimizer.step()
        optimizer.zero_grad()
    accelerator.save_state(str(root / "accelerate"))

    fresh = MemOptPlugin(config)
    other, _, _ = hf_gpt2(batch_size=4, seq=32, dim=32, layers=1)
    shard(fresh.apply(other))
    accelerator._custom_objects.remove(plugin)
    fresh.attach(accelerator)
    accelerator.load_state(str(root / "accelerate"))
    return {
        "distributed type": str(accelerator.distributed_type),
        "bits": plugin.bits,
        "loaded bits": fresh.bits,
        "loaded steps": fresh.steps,
    }


class ShardedGPT2(pl.LightningModule):
    """Hugging Face GPT-2 built and sharded in ``configure_model``, as ``ModelParallelStrategy``
    wants."""

    def __init__(self):
        super().__init__()
        self.model = None

    def configure_model(self):
        if self.model is not None:
            return
        self.model, _, self.lm_loss = hf_gpt2(batch_size=4, seq=32, dim=32, layers=1)
        shard(self.model, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = self.lm_loss(self.model, tokens)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _trainer(root: Path, callbacks: list, max_steps: int, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1),
        max_steps=max_steps,
        callbacks=callbacks,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _lightning(rank: int, root: Path) -> dict:
    """``MemOptCallback`` under ``ModelParallelStrategy(data_parallel_size=2)``: fit 4 steps from
    2 bits with a drift check every 2, a distributed checkpoint at step 2, and a resumed fit."""
    config = {"quantize": {"bits": 2}, "drift": {"check_every": 2, "sample_size": 2}}
    data = DataLoader(TensorDataset(torch.randint(0, 512, (64, 32))), batch_size=4)
    memopt = MemOptCallback(config)
    ckpt = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = _trainer(root, [memopt, ckpt], 4, logger=CSVLogger(root, name="run"))
    trainer.fit(ShardedGPT2(), data)
    rows = []
    if rank == 0:
        with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
    path = root / "ckpt" / "epoch=0-step=2.ckpt"
    saved = torch.load(path / "meta.pt", weights_only=False)["callbacks"]["MemOptCallback"]

    resumed = MemOptCallback(config)
    probe = BitsAtFirstBatch(resumed)
    trainer = _trainer(root, [resumed, probe], 3, logger=False, enable_checkpointing=False)
    trainer.fit(ShardedGPT2(), data, ckpt_path=path)
    return {
        "escalations": [float(r["memopt/escalations"]) for r in rows if r["memopt/escalations"]],
        "state": memopt.state_dict(),
        "saved bits": saved["bits"],
        "resumed bits": probe.bits,
    }


def _cases(out: Path) -> dict:
    return {
        "memory": _memory,
        "losses": _losses,
        "lean": _lean,
        "drift": _drift,
        "accelerate": functools.partial(_accelerate, root=out),
        "lightning": functools.partial(_lightning, root=out),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """One spawned 2-process gloo run of everything below; each rank's results."""
    return run_two_ranks(_cases, tmp_path_factory.mktemp("fsdp2"))


@pytest.mark.slow
def test_recompute_and_bitmask_dropout_train_exactly_as_the_baseline(two_ranks):
    for r in two_ranks:
        losses = r["losses"]
        assert rel(losses["recompute"], losses["baseline"]) < 1e-5
        assert rel(losses["bitmask"], losses["dropout baseline"]) < 1e-5
        assert losses["dropout baseline"] != losses["baseline"]  # dropout drew masks


@pytest.mark.slow
def test_int8_trains_within_2_percent_on_3x_less_retained_memory(two_ranks):
    for r in two_ranks:
        assert rel(r["losses"]["int8"], r["losses"]["baseline"]) < 0.02
        memory = r["memory"]
        assert memory["baseline"] / memory["int8"] >= 3.0


@pytest.mark.slow
def test_drift_checks_that_escalate_nothing_leave_the_run_unchanged(two_ranks):
    """Checks every step at threshold 1.0 (nothing escalates): the same losses and parameters as
    without checks, bit for bit, and the sharded ``.grad`` untouched by each check."""
    for r in two_ranks:
        losses = r["losses"]
        assert losses["checked escalations"] == 0
        assert losses["int8 checked"] == losses["int8"]
        assert all(
            torch.equal(a, b)
            for a, b in zip(losses["int8 checked params"], losses["int8 params"], strict=True)
        )
        assert losses["grads kept"] == [True] * 3


@pytest.mark.slow
def test_lean_ops_train_as_the_unpatched_model_under_fsdp2_and_ddp(two_ranks):
    """Every lean op on a sharded (and a DDP-wrapped) Llama: the unpatched model's losses within
    1e-5, int8 on top within the usual 2%, and DDP's replicas end with the same parameters."""
    for r in two_ranks:
        lean = r["lean"]
        for engine in ("fsdp2", "ddp"):
            assert lean[f"{engine} lean ops"] == [
                "lean attention", "lean loss", "lean mlp", "lean rmsnorm"
            ]  # fmt: skip
            assert rel(lean[f"{engine} lean"], lean[f"{engine} baseline"]) < 1e-5
            assert rel(lean[f"{engine} lean int8"], lean[f"{engine} baseline"]) < 0.02
    for name in ("lean", "lean int8"):  # DDP replicas: the same parameters on both ranks
        mine, theirs = (r["lean"][f"ddp {name} params"] for r in two_ranks)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


@pytest.mark.slow
def test_batchnorm_running_mode_and_bitmask_dropout_per_rank(two_ranks):
    for r in two_ranks:
        bn = r["losses"]["bn"]
        assert rel(bn["memopt"], bn["baseline"]) < 1e-5
        assert torch.allclose(bn["memopt running_mean"], bn["baseline running_mean"])
    # each rank keeps the statistics of its own data
    means = [r["losses"]["bn"]["memopt running_mean"] for r in two_ranks]
    assert not torch.allclose(means[0], means[1])


@pytest.mark.slow
def test_drift_from_2_bits_escalates_and_ranks_always_hold_the_same_bits(two_ranks):
    r0, r1 = (r["drift"] for r in two_ranks)
    assert r0["bits"] == r1["bits"] and r0["escalated"] == r1["escalated"]
    assert r0["escalated"][0] and max(r0["bits"][-1].values()) > 2
    # The same data on both ranks: the shares of each sharded gradient, their squared norms summed
    # over ranks, measure the whole parameter -- the unsharded model's drifts.
    for r in (r0, r1):
        got, want = r["same data"]
        assert set(got) == set(want)
        for fqn, drift in want.items():
            assert got[fqn] == pytest.approx(drift, rel=1e-4), fqn


@pytest.mark.slow
def test_accelerate_plugin_escalates_on_a_sharded_model_and_restores_bits(two_ranks):
    a0, a1 = (r["accelerate"] for r in two_ranks)
    assert a0["distributed type"] == "DistributedType.MULTI_CPU"  # the FSDP plugin set aside
    assert a0["bits"] == a1["bits"] and max(a0["bits"].values()) > 2
    assert a0["loaded bits"] == a1["loaded bits"] == a0["bits"]
    assert a0["loaded steps"] == a1["loaded steps"] == 3


@pytest.mark.slow
def test_lightning_model_parallel_strategy_escalates_and_resumes_with_the_bits(two_ranks):
    l0, l1 = (r["lightning"] for r in two_ranks)
    assert max(l0["escalations"]) > 0
    assert l0["state"]["bits"] == l1["state"]["bits"]
    assert max(l0["state"]["bits"].values()) > 2
    assert l0["saved bits"] == l1["saved bits"] and max(l0["saved bits"].values()) > 2
    assert l0["resumed bits"] == l1["resumed bits"] == l0["saved bits"]
