"""Lightning ``Trainer.fit`` with asynchronous checkpoints through ``AsyncCkptIO``, resumed, then reloaded.

    python examples/lightning_fit.py --dir runs/pl --epochs 2
    python examples/lightning_fit.py --dir runs/pl --epochs 3      # resumes from checkpoints/last.ckpt

Each ``*.ckpt`` Lightning names is an asyncckpt checkpoint directory; ``load_from_checkpoint`` from
``asyncckpt.integrations.lightning`` reads it into a new module (Lightning's own
``MyModule.load_from_checkpoint`` would ``torch.load`` the directory). Needs ``pip install "asyncckpt[dist]"``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from asyncckpt.integrations.lightning import AsyncCkptIO, AsyncCkptPreallocate, load_from_checkpoint


class Regressor(L.LightningModule):
    def __init__(self, width: int = 32, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="the Trainer's default_root_dir")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=gen)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=32)
    last = Path(args.dir) / "checkpoints" / "last.ckpt"
    torch.manual_seed(0)
    model = Regressor()
    trainer = L.Trainer(max_epochs=args.epochs, default_root_dir=args.dir, plugins=[AsyncCkptIO(codec="zstd")],
                        # AsyncCkptPreallocate: the staging is allocated after the first step, not by the first save
                        callbacks=[AsyncCkptPreallocate(),
                                   ModelCheckpoint(dirpath=Path(args.dir) / "checkpoints", save_last=True)],
                        logger=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    print(f"resuming from {last}" if last.exists() else "starting from scratch", flush=True)
    trainer.fit(model, data, ckpt_path=last if last.exists() else None)  # every save committed at the end of fit

    reloaded = load_from_checkpoint(Regressor, last, map_location="cpu")
    same = all(torch.equal(reloaded.state_dict()[k], v.cpu()) for k, v in model.state_dict().items())
    print(f"epoch {trainer.current_epoch}, step {trainer.global_step}; load_from_checkpoint equals the model: {same}")


if __name__ == "__main__":
    main()
