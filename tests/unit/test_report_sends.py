"""The report's grid of what each method sends, from the images a run wrote to TensorBoard (the server's, or for
FedST's panels of a site's own data, the sites' own folders)."""

from __future__ import annotations

import numpy as np

from medflare.report.sends import SEND_TAGS, last_images, plot_sends, tb_roots


def _workspace(tmp_path, owner: str, images: dict[str, list[np.ndarray]], at_site: bool = False):
    """A simulator-like workspace whose server TensorBoard folder holds ``{tag: [image per step]}`` of ``owner``
    (``at_site``: the site ``owner``'s own folder, ``<ws>/<owner>/simulate_job/tb_events/<owner>``, holds them)."""
    from torch.utils.tensorboard import SummaryWriter

    ws = tmp_path / f"ws_{owner}{'_at_site' if at_site else ''}"
    (ws / "server" / "simulate_job" / "tb_events").mkdir(parents=True, exist_ok=True)
    folder = ws / owner / "simulate_job" / "tb_events" / owner if at_site else ws / "server" / "simulate_job" / "tb_events" / owner
    writer = SummaryWriter(str(folder))
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


def test_fedst_panels_are_read_from_the_sites_own_folders_where_they_stay(tmp_path):
    """FedST's real | synthetic | label panels stay at the sites by default; the report (all sites run locally) reads
    them there, and from the server's folder for a site that opted in to streaming them."""
    kept = _workspace(tmp_path, "site-1", {"synthetic/b/case0": [_solid(30), _solid(120)], "val/case0": [_solid(5)]}, at_site=True)
    record = {"label": "FedST-join", "workspace": str(kept)}
    roots = tb_roots(record, at_sites=True)
    assert roots == [kept / "site-1" / "simulate_job" / "tb_events", kept / "server" / "simulate_job" / "tb_events"]
    assert tb_roots(record, at_sites=False) == [kept / "server" / "simulate_job" / "tb_events"]
    ((name, img),) = last_images(roots[0], "synthetic/")
    assert name == "site-1/synthetic/b/case0" and int(img.mean()) == 120
    assert SEND_TAGS["fedst_join"][2] and "kept at the sites" in SEND_TAGS["fedst_join"][1]
    assert not SEND_TAGS["fedvck"][2] and not SEND_TAGS["fediod"][2]  # made by the server: read there
    assert plot_sends({"fedst_join": [record]}, "Segmentation", tmp_path / "sends.png") == tmp_path / "sends.png"
    streamed = _workspace(tmp_path, "site-2", {"synthetic/a/case0": [_solid(60)]})  # a site that opted in
    assert plot_sends({"fedst_separate": [{"label": "FedST", "workspace": str(streamed)}]}, "S", tmp_path / "s2.png") is not None
