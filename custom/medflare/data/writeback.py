"""Predictions on the stored image's own grid: written back next to the data, and scored in physical units.

An image goes through the preset's preprocessing with MONAI's metadata tracking on (orientation,
resampling, resizing are recorded), the model predicts on that grid (a volume slice by slice or by
sliding windows, :mod:`medflare.metrics.inference`), and MONAI's ``Invertd`` maps the label map back
onto the stored grid (nearest neighbour). ``medflare predict`` writes it with MONAI's ``SaveImage``:
NIfTI with the stored image's affine and header (so it opens over the original in a clinical viewer),
PNG for PNG/JPEG images. ``medflare evaluate`` on volumes scores it against the stored label with the
stored voxel spacing (mm). A classification prediction is a row of ``predictions.csv``. Generated
images (``medflare sample``) are NIfTI with the conditioning label map's affine.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import nibabel as nib
import numpy as np
import torch
from monai.data import MetaTensor
from monai.transforms import Compose, Invertd, SaveImage

from medflare import ConfigError
from medflare.data.datalists import read_datalist, site_splits, split_keys
from medflare.data.loaders import make_loader
from medflare.data.transforms import NIFTI_SUFFIXES, PIL_SUFFIXES, LoadPair, check_image_size, label_transforms, preprocess
from medflare.data.volumes import VolumeLayout, volume_transform
from medflare.metrics import logits_to_label_map
from medflare.metrics.inference import VolumeInference

Forward = Callable[[torch.Tensor], torch.Tensor]


def _stem(path: str) -> str:
    name = Path(path).name
    for suffix in (*NIFTI_SUFFIXES, *PIL_SUFFIXES):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return Path(name).stem


def _first(value: Any) -> str:
    return str(value[0] if isinstance(value, (list, tuple)) else value)


def is_volume_preset(data_cfg: Mapping[str, Any]) -> bool:
    """Whether a preset's data are 3D volumes (scored and written per volume)."""
    return data_cfg.get("kind") == "volumes"


def _pipeline(data_cfg: Mapping[str, Any], num_classes: int) -> tuple[Compose, Callable[[Forward], Forward], int]:
    """(preprocessing of an image with metadata kept, how a forward becomes a whole-image predictor, spatial dims)."""
    if is_volume_preset(data_cfg):
        layout = VolumeLayout.from_config(data_cfg)
        pre = volume_transform(data_cfg, layout, num_classes, keep_meta=True, has_label=False)
        return pre, VolumeInference(**layout.inference()).wrap, 3
    prep = data_cfg if data_cfg.get("kind") == "datalist" else {}  # synthetic data is stored at the model's size
    chain = preprocess(prep, spatial_dims=2, num_classes=num_classes, has_label=False, size=check_image_size(prep))
    return Compose(chain), (lambda forward: forward), 2


def predict_on_stored_grid(predictor: Forward, entries: Sequence[Mapping[str, Any]], data_cfg: Mapping[str, Any],
                           num_classes: int, device) -> Iterator[tuple[Mapping[str, Any], MetaTensor]]:
    """For each entry, its predicted label map ``(1, *stored spatial shape)`` on the stored image's grid.

    The MetaTensor carries the stored affine, so :class:`SaveImage` writes it where the image lies.
    """
    pre, wrap, _ = _pipeline(data_cfg, num_classes)
    forward = wrap(predictor)
    invert = Invertd(keys="pred", transform=pre, orig_keys="image", nearest_interp=True)
    with torch.no_grad():
        for entry in entries:
            item = pre({"image": entry["image"]})
            image = item["image"]
            labels = logits_to_label_map(forward(image.as_tensor()[None].to(device)), num_classes)[0].cpu()
            pred = MetaTensor(labels.float(), meta=dict(image.meta))
            if image.applied_operations:  # resized / reoriented / resampled: back onto the stored grid
                pred = invert({"pred": pred, "image": image})["pred"]
            yield entry, pred


def stored_label(entry: Mapping[str, Any], data_cfg: Mapping[str, Any], num_classes: int) -> MetaTensor:
    """An entry's label as stored (channel-first), its values mapped to classes as the preset says."""
    dims = 3 if is_volume_preset(data_cfg) else 2
    label = LoadPair(dims, kind=str(data_cfg.get("kind"))).read(entry["label"], "label")
    mapped = Compose(label_transforms(data_cfg, num_classes))({"label": label, "src_label": entry["label"]})
    return mapped["label"]


def scored_batches(predictor: Forward, entries: Sequence[Mapping[str, Any]], data_cfg: Mapping[str, Any],
                   num_classes: int, device) -> Iterator[dict[str, Any]]:
    """Batches for :func:`medflare.metrics.evaluate` (with ``predict=`` identity) of one case each, on the stored grid.

    ``{"image": predicted label map (1, 1, *spatial), "label": stored label (1, 1, *spatial), "spacing": (1, dims)
    stored voxel size in mm, "name": [file name]}``: metrics of the prediction as it is delivered.
    """
    for entry, pred in predict_on_stored_grid(predictor, entries, data_cfg, num_classes, device):
        label = stored_label(entry, data_cfg, num_classes)
        if tuple(label.shape) != tuple(pred.shape):
            raise ConfigError(f"prediction of '{_first(entry['image'])}' has shape {tuple(pred.shape)} but its label "
                              f"'{_first(entry['label'])}' has {tuple(label.shape)}")
        spacing = torch.as_tensor(label.pixdim, dtype=torch.float32)[: label.ndim - 1]
        yield {"image": pred.as_tensor()[None].long(), "label": label.as_tensor()[None].long(),
               "spacing": spacing[None], "name": [Path(_first(entry["image"])).name]}


def volume_entries(datalist: str | Path, split: str, data_cfg: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Labeled entries of ``split`` of a volume datalist, split as a site splits it (an MSD dataset.json included)."""
    key, _ = split_keys(split)
    return site_splits(datalist, val_fraction=float(data_cfg.get("val_fraction", 0.2)),
                       test_fraction=float(data_cfg.get("test_fraction", 0.2)), seed=int(data_cfg.get("seed", 0)))[key]


def _save_nifti(pred: MetaTensor, reference: str, path: Path) -> Path:
    """``pred`` as NIfTI at ``path`` (no suffix) with the reference image's header (its affine is on ``pred``)."""
    header = nib.load(reference).header.copy()
    header.set_data_dtype(np.uint8)
    saver = SaveImage(output_ext=".nii.gz", output_dtype=np.uint8, resample=False, separate_folder=False, print_log=False)
    saver.set_options(write_kwargs={"header": header})
    saver(pred, filename=str(path))
    return path.with_name(path.name + ".nii.gz")


def save_like(array: np.ndarray, reference: str, out: Path) -> Path:
    """Write a 2D/3D ``array`` as NIfTI with ``reference``'s affine and header (PNG if the reference is not NIfTI)."""
    if str(reference).lower().endswith(NIFTI_SUFFIXES):
        ref = nib.load(reference)
        header = ref.header.copy()
        header.set_data_dtype(array.dtype)
        path = out.with_name(out.name + ".nii.gz")
        nib.save(nib.Nifti1Image(array, ref.affine, header), path)
        return path
    from PIL import Image

    path = out.with_name(out.name + ".png")
    Image.fromarray(np.asarray(array, dtype=np.uint8)).save(path)
    return path


@torch.no_grad()
def write_predictions(predictor, data_cfg: Mapping[str, Any], out: str | Path, device, *, datalist: str | None = None,
                      npz: str | None = None, split: str = "testing", batch_size: int = 8) -> list[Path]:
    """Predict every image of ``datalist`` / ``npz`` (split ``split``) into folder ``out``.

    Segmentation: one label map per image on the image's own grid, ``<stem>_pred.nii.gz`` (MONAI SaveImage,
    the image's affine and header) or ``<stem>_pred.png``; entries need no label (MSD ``test`` images).
    """
    from medflare.data import load_npz_split
    from medflare.metrics import to_class_labels

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    num_classes = int(data_cfg["num_classes"])
    if isinstance(predictor, torch.nn.Module):
        predictor.eval()
    if npz:
        dataset = load_npz_split(npz, split, num_classes=num_classes)
        path = out / "predictions.csv"
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["name", "prediction", "label"])
            for batch in make_loader(dataset, batch_size, False):
                pred = to_class_labels(predictor(batch["image"].to(device))).cpu().tolist()
                writer.writerows(zip(batch["name"], pred, batch["label"].tolist()))
        return [path]
    entries = read_datalist(datalist, split, labeled=False)
    written = []
    for entry, pred in predict_on_stored_grid(predictor, entries, data_cfg, num_classes, device):
        reference = _first(entry["image"])
        target = out / f"{_stem(reference)}_pred"
        if reference.lower().endswith(NIFTI_SUFFIXES):
            written.append(_save_nifti(pred, reference, target))
        else:
            written.append(save_like(pred.as_tensor()[0].numpy().astype(np.uint8), reference, target))
    return written


def write_samples(result, options: Mapping[str, Any], out: str | Path, device, *, labels: str | None = None,
                  split: str = "testing", num: int = 8, seed: int = 0) -> list[Path]:
    """Generate with ``result.sample`` from the label maps of datalist ``labels`` (split ``split``), or ``num``
    unconditioned images, into folder ``out``; ``seed`` seeds the sampler."""
    from medflare.data import load_seg_split

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    options = {**options, "num": num, "seed": seed}
    if not labels:
        images = result.sample([], options)
        written = []
        for i, image in enumerate(images):
            path = out / f"sample_{i:04d}.nii.gz"
            nib.save(nib.Nifti1Image(image.cpu().numpy().squeeze(0).astype(np.float32), np.eye(4)), path)
            written.append(path)
        return written
    num_classes = int(result.description["data"]["num_classes"])
    entries = read_datalist(labels, split)
    dataset = load_seg_split(labels, split, num_classes=num_classes, cache=False)
    label_maps = [dataset[i]["label"].to(device) for i in range(len(dataset))]
    images = result.sample(label_maps, options)
    if len(images) != len(label_maps):
        raise ConfigError(f"kind '{result.kind}' returned {len(images)} samples for {len(label_maps)} label maps")
    return [
        save_like(image.cpu().numpy().squeeze(0).astype(np.float32), entry["label"], out / f"{_stem(entry['label'])}_synthetic")
        for image, entry in zip(images, entries)
    ]
