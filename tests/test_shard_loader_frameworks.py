"""ShardLoader where users train: a Lightning DataModule and an Accelerate loop, as docs/loader.md shows them.

Both frameworks keep the loader's state in their own checkpoints (Lightning's fit
loop saves a dataloader's state_dict; Accelerate's register_for_checkpointing), and
a run resumed from one reads the same batches as the run that went on.
"""

from __future__ import annotations

import torch

from tpustream.data import ShardLoader

TRAIN = "train/train-{000003..000005}.tar"  # 670 samples: 21 batches of 32


def digits(root: str, rank: int, world_size: int) -> ShardLoader:
    """The loader both frameworks' runs read, on the rank and world the framework gives."""
    options = {"batch_size": 32, "num_workers": 0, "seed": 3}
    return ShardLoader(f"{root}/{TRAIN}", rank=rank, world_size=world_size, **options)


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(3 * 32 * 32, 10)

    def loss(self, batch: dict) -> torch.Tensor:
        images = batch["image"].float().flatten(1) / 255  # normalising is the loop's
        weight = batch["real"].float()  # padding weighs nothing
        losses = torch.nn.functional.cross_entropy(self.net(images), batch["label"], reduction="none")
        return (losses * weight).sum() / weight.sum().clamp(min=1)


def test_a_lightning_datamodule_resumes_mid_epoch_on_the_same_batches(digits_root, tmp_path):
    import lightning as L

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.seen = Tiny(), []

        def training_step(self, batch: dict, index: int) -> torch.Tensor:
            self.seen.append(batch["sample_id"].tolist())
            return self.model.loss(batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Digits(L.LightningDataModule):
        def setup(self, stage: str) -> None:
            self.train = digits(digits_root, self.trainer.global_rank, self.trainer.world_size)

        def train_dataloader(self) -> ShardLoader:
            return self.train

    def trainer(steps: int) -> L.Trainer:
        quiet = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
        # The loader splits over the ranks itself: no sampler for Lightning to add.
        return L.Trainer(
            max_steps=steps, accelerator="cpu", devices=1, enable_checkpointing=False,
            use_distributed_sampler=False, **quiet,
        )  # fmt: skip

    straight = Classifier()
    trainer(15).fit(straight, Digits())
    first, stopped = Classifier(), trainer(8)
    stopped.fit(first, Digits())
    checkpoint = tmp_path / "step8.ckpt"
    stopped.save_checkpoint(checkpoint)
    saved = torch.load(checkpoint, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert [(s["epoch"], s["step"]) for s in saved] == [(0, 8)]  # Lightning kept the loader's state
    resumed = Classifier()
    trainer(15).fit(resumed, Digits(), ckpt_path=checkpoint)
    assert first.seen + resumed.seen == straight.seen


def test_an_accelerate_loop_keeps_the_loader_in_its_saved_state(digits_root, tmp_path, monkeypatch):
    # Accelerate takes the XLA device whenever torch_xla imports, cpu=True or not; never in
    # pytest's process (eager backward beside XLA). USE_TORCH_XLA is read when it is imported.
    monkeypatch.setenv("USE_TORCH_XLA", "0")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import send_to_device

    def run(steps: int, state: str | None = None, save: str | None = None) -> list[list[int]]:
        # Each run as in a process of its own, as accelerate's tests do it (its state is a singleton).
        AcceleratorState._reset_state(reset_partial_state=True)
        accelerator = Accelerator(cpu=True)
        assert accelerator.device.type == "cpu"
        model = Tiny()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)  # not the loader: it splits itself
        loader = digits(digits_root, accelerator.process_index, accelerator.num_processes)
        accelerator.register_for_checkpointing(loader)
        if state is not None:
            accelerator.load_state(state)
        seen = []
        for batch in loader:
            seen.append(batch["sample_id"].tolist())
            loss = model.loss(send_to_device(batch, accelerator.device))  # tensors moved, "key" kept
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if len(seen) == steps:
                break
        if save is not None:
            accelerator.save_state(save)
        return seen

    straight = run(15)
    first = run(8, save=str(tmp_path / "state"))
    assert first + run(7, state=str(tmp_path / "state")) == straight
