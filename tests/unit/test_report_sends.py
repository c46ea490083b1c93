"""The report's grid of what each method sends, from the images a run streamed to TensorBoard."""

from __future__ import annotations

import numpy as np

from medflare.report.sends import last_images, plot_sends


def _workspace(tmp_path, owner: str, images: dict[str, list[np.ndarray]]):
    """A simulator-like workspace whose server TensorBoard folder holds ``{tag: [image per step]}`` of ``owner``."""
    from torch.utils.tensorboard import SummaryWriter

    ws = tmp_path / f"ws_{owner}"
    writer = SummaryWriter(str(ws / "server" / "simulate_job" / "tb_events" / owner))
    for tag, steps in images.items():
        for step, img in enumerate(steps):
            writer.add_image(tag, img, step)  # CHW uint8, as medflare's tracker sends
    writer.close()
    return ws


def _solid(value: int, h: int = 8, w: int = 12) -> np.ndarray:
    return np.full((3, h, w), value, dtype=np.uint8)


def test_last_images_takes_the_last_step_of_each_matching_tag(tmp_path):
    ws = _workspace(tmp_path, "simulator_server", {"condensed/class_0": [_solid(10), _solid(200)],
                                                   "condensed/class_1": [_solid(90)], "val/case0": [_solid(5)]})
    images = last_images(ws / "server" / "simulate_job" / "tb_events", "condensed/")
    assert [name for name, _ in images] == ["simulator_server/condensed/class_0", "simulator_server/condensed/class_1"]
    assert images[0][1].shape == (8, 12, 3) and int(images[0][1].mean()) == 200  # the last round's, not the first
    assert int(images[1][1].mean()) == 90
    assert len(last_images(ws / "server" / "simulate_job" / "tb_events", "condensed/", limit=1)) == 1


def test_plot_sends_one_row_per_method_with_images_and_none_without(tmp_path):
    vck = _workspace(tmp_path, "simulator_server", {"condensed/class_0": [_solid(50)]})
    fedavg = {"label": "FedAvg", "workspace": str(_workspace(tmp_path, "site-1", {"val/case0": [_solid(5)]}))}
    fedst = {"label": "FedST-join", "workspace": str(_workspace(tmp_path, "site-2", {"val/case0": [_solid(5)]}))}
    path = tmp_path / "sends.png"
    # FedST-join streamed no synthetic/ images in this run: left out; FedAvg sends weights: never drawn
    assert plot_sends({"fedavg": [fedavg], "fedst_join": [fedst]}, "t", path) is None and not path.exists()
    runs = {"fedavg": [fedavg], "fedvck": [{"label": "FedVCK", "workspace": str(vck)}], "local": [{"label": "local only"}]}
    assert plot_sends(runs, "Classification", path) == path
    from matplotlib import image as mpimg

    assert mpimg.imread(path).shape[0] > 100
