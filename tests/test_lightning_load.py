"""Lightning: loading AsyncCkptIO checkpoints where the saving device is absent, and ``load_from_checkpoint``.

A checkpoint "saved on a GPU" is made here by writing what a GPU save records, ``"device": "cuda:0"``
for every tensor, into a real checkpoint's manifest (resealed with its digest): this machine has no
GPU, and the device field is all that differs on disk for a CPU reader (the GPU tests save on the
GPU itself). Real ``Trainer.fit`` and Lightning's own ``load_from_checkpoint`` throughout.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import asyncckpt  # noqa: E402
from asyncckpt._manifest import MANIFEST_NAME  # noqa: E402
from asyncckpt._manifest_digest import DIGEST_FIELD, seal  # noqa: E402
from asyncckpt.integrations.lightning import AsyncCkptIO, AsyncCkptLoadable, load_from_checkpoint  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning:lightning"),
    pytest.mark.filterwarnings("ignore::FutureWarning:lightning"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*isinstance.treespec, LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty:UserWarning"),
    # Resuming into a new directory, as a CPU-only machine would: Lightning notes the checkpoint directory changed.
    pytest.mark.filterwarnings("ignore:The dirpath has changed:UserWarning"),
    pytest.mark.timeout(180),
]


class Net(L.LightningModule):
    def __init__(self, width: int = 8, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(width, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class LoadableNet(AsyncCkptLoadable, Net):
    pass


@pytest.fixture(autouse=True)
def _deterministic_mode_restored() -> Iterator[None]:
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def _data() -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(32, 8, generator=gen), torch.randn(32, 1, generator=gen)), batch_size=8)


def _fit(root: Path, epochs: int, ckpt_path: Path | None = None, io: L.pytorch.plugins.CheckpointIO | None = None,
         model: Net | None = None) -> Net:  # fmt: skip
    torch.manual_seed(0)
    model = model if model is not None else Net(width=8, lr=0.05)
    checkpoints = ModelCheckpoint(dirpath=root / "checkpoints", save_last=True)
    trainer = L.Trainer(max_epochs=epochs, default_root_dir=root, plugins=[io or AsyncCkptIO(codec="zstd")],
                        callbacks=[checkpoints], logger=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu")  # fmt: skip
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    return model


def _as_if_saved_on_cuda(checkpoint: Path) -> None:
    path = checkpoint / MANIFEST_NAME
    doc = json.loads(path.read_text())
    for record in doc["tensors"]:
        record["device"] = "cuda:0"
    del doc[DIGEST_FIELD]
    path.write_bytes(seal(doc))


def test_a_gpu_saved_checkpoint_resumes_on_a_cpu_only_machine(tmp_path: Path) -> None:
    _fit(tmp_path, epochs=1)
    last = tmp_path / "checkpoints" / "last.ckpt"
    _as_if_saved_on_cuda(last)
    if not torch.cuda.is_available():  # what a plain load does here: the saving device is absent
        with pytest.raises(asyncckpt.CheckpointError, match="CUDA is not available"):
            asyncckpt.load(last)
    state = AsyncCkptIO().load_checkpoint(last)  # Lightning passes no map_location: the CPU, as TorchCheckpointIO
    assert state["global_step"] == 4 and state["state_dict"]["net.weight"].device.type == "cpu"
    resumed = _fit(tmp_path / "resume", epochs=2, ckpt_path=last)  # Trainer.fit resumes through the plugin
    straight = _fit(tmp_path / "straight", epochs=2)
    assert torch.equal(resumed.net.weight, straight.net.weight)
    for refused in ({"cuda:0": "cpu"}, lambda storage, loc: storage.to("meta")):
        with pytest.raises(TypeError, match="map_location must be a device"):
            AsyncCkptIO().load_checkpoint(last, map_location=refused)


def test_load_from_checkpoint(tmp_path: Path) -> None:
    trained = _fit(tmp_path, epochs=1)
    last = tmp_path / "checkpoints" / "last.ckpt"
    with pytest.raises(IsADirectoryError):  # Lightning's own loader reads with torch.load, not through the plugin
        Net.load_from_checkpoint(last)

    loaded = load_from_checkpoint(Net, last)
    assert isinstance(loaded, Net) and loaded.hparams.lr == 0.05 and loaded.hparams.width == 8
    assert torch.equal(loaded.net.weight, trained.net.weight)
    override = load_from_checkpoint(Net, last, lr=0.5, map_location="cpu")  # kwargs override hyper-parameters
    assert override.hparams.lr == 0.5 and torch.equal(override.net.weight, trained.net.weight)

    via_mixin = LoadableNet.load_from_checkpoint(last)
    assert isinstance(via_mixin, LoadableNet) and torch.equal(via_mixin.net.weight, trained.net.weight)
    _as_if_saved_on_cuda(last)
    assert LoadableNet.load_from_checkpoint(last).net.weight.device.type == "cpu"
    with pytest.raises(FileNotFoundError, match=r"Net.load_from_checkpoint"):
        load_from_checkpoint(Net, tmp_path / "nothing.ckpt")

    # A plain torch.save checkpoint still loads through the mixin (Lightning's own path).
    plain = _fit(tmp_path / "plain", epochs=1, io=L.pytorch.plugins.TorchCheckpointIO(), model=LoadableNet(lr=0.05))
    again = LoadableNet.load_from_checkpoint(tmp_path / "plain" / "checkpoints" / "last.ckpt")
    assert torch.equal(again.net.weight, plain.net.weight)
