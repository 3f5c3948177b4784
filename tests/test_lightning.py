"""Lightning: a real Trainer.fit saving through AsyncCkptIO, and a resume from its checkpoint that continues
bit-for-bit like an uninterrupted run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import asyncckpt  # noqa: E402
from asyncckpt.integrations.lightning import AsyncCkptIO, AsyncCkptPreallocate  # noqa: E402

pytestmark = [
    # Lightning's own internals warn about torch APIs it uses; not ours to fix.
    pytest.mark.filterwarnings("ignore::DeprecationWarning:lightning"),
    pytest.mark.filterwarnings("ignore::FutureWarning:lightning"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*isinstance.treespec, LeafSpec.*"),
    # Resuming into the run's own checkpoint directory, as a user would: Lightning notes it is not empty.
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty:UserWarning"),
    pytest.mark.timeout(180),
]


class Regressor(L.LightningModule):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()  # stored in the checkpoint as an AttributeDict
        self.net = torch.nn.Sequential(torch.nn.Linear(width, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


@pytest.fixture(autouse=True)
def _deterministic_mode_restored() -> Iterator[None]:
    # Trainer(deterministic=True) switches torch's deterministic algorithms on for the whole
    # process and leaves them on; later tests must not inherit it (a dedicated test in
    # tests/test_roundtrip.py saves under it on purpose).
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def _data() -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(64, 16, generator=gen), torch.randn(64, 1, generator=gen)),
                      batch_size=16, shuffle=False)  # fmt: skip


def _trainer(root: Path, epochs: int, plugins: list | None = None) -> L.Trainer:
    checkpoints = ModelCheckpoint(dirpath=root / "checkpoints", save_top_k=-1, save_last=True, every_n_epochs=1)
    return L.Trainer(max_epochs=epochs, default_root_dir=root, plugins=plugins, callbacks=[checkpoints],
                     logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                     deterministic=True)  # fmt: skip


def _fit(root: Path, epochs: int, ckpt_path: Path | None = None) -> Regressor:
    torch.manual_seed(0)
    model = Regressor()
    _trainer(root, epochs, plugins=[AsyncCkptIO(codec="zstd")]).fit(model, _data(), ckpt_path=ckpt_path)
    return model


def test_fit_saves_asynchronously_and_resume_continues_exactly(tmp_path: Path) -> None:
    two = _fit(tmp_path / "a", epochs=2)
    checkpoints = tmp_path / "a" / "checkpoints"
    names = sorted(p.name for p in checkpoints.iterdir())
    assert names == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"], names
    for name in names:  # each is a committed asyncckpt checkpoint directory, verified end to end
        assert (checkpoints / name / "manifest.json").is_file()
        asyncckpt.verify(checkpoints / name)
    last = AsyncCkptIO().load_checkpoint(checkpoints / "last.ckpt")
    assert last["global_step"] == 8 and last["epoch"] == 1
    assert last["hyper_parameters"] == {"width": 16}
    for key, value in two.state_dict().items():
        assert torch.equal(last["state_dict"][key], value), key
    assert last["optimizer_states"][0]["state"][0]["exp_avg"].abs().sum() > 0

    resumed = _fit(tmp_path / "a", epochs=3, ckpt_path=checkpoints / "last.ckpt")
    straight = _fit(tmp_path / "b", epochs=3)
    for key, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), f"{key}: resumed run diverged from a straight run"
    assert AsyncCkptIO().load_checkpoint(checkpoints / "last.ckpt")["global_step"] == 12
    assert sorted(p.name for p in checkpoints.iterdir()) == [*names[:2], "epoch=2-step=12.ckpt", "last.ckpt"]


def test_remove_checkpoint_and_unsupported_values(tmp_path: Path) -> None:
    io = AsyncCkptIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 1}, tmp_path / "x.ckpt")
    io.remove_checkpoint(tmp_path / "x.ckpt")  # waits for the save in flight, then deletes it whole
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TypeError, match="callbacks/Odd/fn"):  # no pickle: an object it cannot store is named
        io.save_checkpoint({"callbacks": {"Odd": {"fn": print}}}, tmp_path / "y.ckpt")
    io.teardown()


class _Staging(L.Callback):
    """The plugin's host staging at step 2 (before the first save, at the epoch's end, once any
    preallocation has finished) and when training ends (after that save, before the plugin's teardown)."""

    def __init__(self, preallocation: AsyncCkptPreallocate | None) -> None:
        self.preallocation = preallocation
        self.before_first_save: int | None = None
        self.after_first_save: int | None = None
        self.directory: Path | None = None

    @staticmethod
    def _bytes(trainer: L.Trainer) -> int:
        checkpointer = trainer.strategy.checkpoint_io._checkpointer  # type: ignore[attr-defined]
        return 0 if checkpointer is None else checkpointer._backend.stager.host_staging_bytes()

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == 2 and self.before_first_save is None:
            if self.preallocation is not None and self.preallocation.thread is not None:
                self.preallocation.thread.join(60)
            self.before_first_save = self._bytes(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        checkpointer = trainer.strategy.checkpoint_io._checkpointer  # type: ignore[attr-defined]
        checkpointer.wait()
        self.directory = checkpointer.directory
        self.after_first_save = self._bytes(trainer)


def _fit_probed(root: Path, preallocation: AsyncCkptPreallocate | None) -> tuple[_Staging, Regressor]:
    torch.manual_seed(0)
    model = Regressor(width=64)  # its first layer's weight (8 KiB) goes through the staging; smaller ones are cloned
    probe = _Staging(preallocation)
    gen = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 64, generator=gen), torch.randn(64, 1, generator=gen)),
                      batch_size=16)  # fmt: skip
    trainer = _trainer(root, epochs=1, plugins=[AsyncCkptIO(codec="zstd")])
    trainer.callbacks = [*([preallocation] if preallocation else []), probe, *trainer.callbacks]
    trainer.fit(model, data)
    return probe, model


def test_the_preallocate_callback_allocates_the_staging_after_the_first_step_not_at_the_first_save(
    tmp_path: Path,
) -> None:
    """Without AsyncCkptPreallocate the first save allocates the staging; with it, the staging exists
    before the first save, as large as that save needs (it then allocates nothing more), in the
    checkpoints' directory, and again in a second fit with the same callback (the plugin's teardown
    closed the first fit's). The save into that staging is whole."""
    plain, _model = _fit_probed(tmp_path / "plain", None)
    assert plain.before_first_save == 0 and plain.after_first_save is not None and plain.after_first_save > 0
    preallocation = AsyncCkptPreallocate()
    for run in ("first", "second"):
        probe, model = _fit_probed(tmp_path / run, preallocation)
        assert preallocation.thread is not None and probe.directory == tmp_path / run / "checkpoints", run
        assert probe.before_first_save == probe.after_first_save == plain.after_first_save, run
        saved = asyncckpt.load(tmp_path / run / "checkpoints" / "epoch=0-step=4.ckpt")
        for key, value in model.state_dict().items():
            assert torch.equal(saved["state_dict"][key], value), key
