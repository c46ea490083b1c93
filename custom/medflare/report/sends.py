"""The report's picture of what each method sends, from the images its run wrote to TensorBoard.

What leaves a site differs by method, and for three of them an image shows it better than a byte count:

- FedVCK: the condensed images the sites send (the server's ``condensed/class_<c>`` grids of what it received);
- FedIOD / FedIOD-seg: the server generator's samples the sites label with their logits (``generated/samples``;
  the sites send logits on these, never images of their own);
- FedST-separate / FedST-join: images from the generators the sites send, in other sites' styles (the sites'
  ``synthetic/<domain>/case<i>`` panels: real image, synthetic cross-domain image, label map).

FedVCK's and FedIOD's pictures are made by the server and read from the server's TensorBoard. FedST's panels show a
site's own images and label maps: they are kept at the sites (each site's own TensorBoard,
``<ws>/<site>/simulate_job/tb_events/<site>/``, unless the site opts in to ``privacy.stream_images``), and are shown
here only because the report runs every site locally (one person benchmarking on all sites' data); they are read
from the sites' folders, then from the server's (a site that opted in streamed them there).

Weight-sharing rows (FedAvg, FedProx, SCAFFOLD, FedSM) send network weights: nothing to picture; they are left out.
The images are read from the row's simulator workspace (``record["workspace"]``, kept under the report's
``runs/`` folder), last step of each tag, so the grid shows the final round's payloads of the first seed.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

_AT_SITES = ("real | synthetic cross-domain | label (from the generators the sites send); kept at the sites, "
             "shown here because the report runs every site locally")
#: method name -> (tag prefix of its images, caption, whether the pictures are kept at the sites)
SEND_TAGS: dict[str, tuple[str, str, bool]] = {
    "fedvck": ("condensed/", "condensed images (sent by the sites)", False),
    "fediod": ("generated/", "generator samples (the sites send logits on them)", False),
    "fediod_seg": ("generated/", "generator samples (the sites send logits on them)", False),
    "fedst_separate": ("synthetic/", _AT_SITES, True),
    "fedst_join": ("synthetic/", _AT_SITES, True),
}


def tb_root(record: Mapping[str, Any]) -> Path | None:
    """The server's TensorBoard folder of a federated record's run (None for a standalone row)."""
    ws = record.get("workspace")
    return Path(ws) / "server" / "simulate_job" / "tb_events" if ws else None


def tb_roots(record: Mapping[str, Any], at_sites: bool) -> list[Path]:
    """Where a run's pictures are: the server's TensorBoard folder, or (``at_sites``) each site's own
    (``<ws>/<site>/simulate_job/tb_events``) then the server's, for a site that opted in to streaming them."""
    server = tb_root(record)
    if server is None:
        return []
    ws = Path(record["workspace"])
    sites = sorted(p / "simulate_job" / "tb_events" for p in ws.iterdir()
                   if p.is_dir() and p.name != "server" and (p / "simulate_job").is_dir()) if at_sites and ws.is_dir() else []
    return [*sites, server]


def last_images(root: Path, prefix: str, limit: int = 4) -> list[tuple[str, np.ndarray]]:
    """``[(owner/tag, HxWx3 uint8)]``: the last-step image of each tag starting with ``prefix`` under ``root/<owner>/``
    (owner: a site, or the server's own folder), sorted by owner and tag, at most ``limit``."""
    from matplotlib import image as mpimg
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: list[tuple[str, np.ndarray]] = []
    if not root.is_dir():
        return out
    for owner in sorted(p for p in root.iterdir() if p.is_dir()):
        acc = EventAccumulator(str(owner), size_guidance={"images": 0, "scalars": 1})
        acc.Reload()
        for tag in sorted(t for t in acc.Tags().get("images", []) if t.startswith(prefix)):
            event = max(acc.Images(tag), key=lambda e: e.step)
            img = mpimg.imread(io.BytesIO(event.encoded_image_string), format="png")
            img = (np.clip(img, 0, 1) * 255).astype(np.uint8) if img.dtype != np.uint8 else img
            out.append((f"{owner.name}/{tag}", img[..., :3] if img.ndim == 3 else np.repeat(img[..., None], 3, axis=2)))
            if len(out) >= limit:
                return out
    return out


def plot_sends(runs: Mapping[str, Iterable[Mapping[str, Any]]], title: str, path: Path, per_method: int = 4) -> Path | None:
    """One row of images per method of ``runs`` (``{method: [record per seed]}``, as
    :func:`medflare.report.tables.group` gives) that wrote images of what it sends (FedST's: read from the sites' own
    folders, see the module docstring); writes ``path`` and returns it, or None (nothing written) when no method of
    the table has such images."""
    found = []
    for method, records in runs.items():
        if method not in SEND_TAGS:
            continue
        first = next(iter(records), None)
        prefix, _, at_sites = SEND_TAGS[method]
        images = []
        try:
            for root in tb_roots(first, at_sites) if first else []:
                images += last_images(root, prefix, per_method - len(images))
                if len(images) >= per_method:
                    break
        except Exception as exc:  # noqa: BLE001 - an unreadable event file costs its row, never the report
            print(f"sends figure: {method} skipped ({type(exc).__name__}: {exc})")
            images = []
        if images:
            found.append((first.get("label", method), SEND_TAGS[method][1], images))
    if not found:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = max(len(images) for _, _, images in found)
    fig = plt.figure(figsize=(2.6 * cols, 1.9 * len(found) + 0.5))
    grid = fig.add_gridspec(len(found), cols)
    for r, (label, caption, images) in enumerate(found):
        # a row of one image (FedIOD's sample grid: one wide strip) spans the whole row instead of one narrow cell
        spans = [grid[r, :]] if len(images) == 1 else [grid[r, c] for c in range(len(images))]
        axes = [fig.add_subplot(span) for span in spans]
        for ax, (name, img) in zip(axes, images):
            ax.axis("off")
            ax.imshow(img, interpolation="nearest")
            ax.set_title(name, fontsize=6)
        axes[0].text(-0.05, 0.5, f"{label}\n{caption}", transform=axes[0].transAxes, ha="right", va="center",
                     fontsize=7, wrap=True)
    fig.suptitle(f"{title}: what the methods send")
    fig.tight_layout(rect=(0.12, 0, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
