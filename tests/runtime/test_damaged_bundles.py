"""A damaged bundle, or a path that is no bundle's stem, is refused naming the file.

Before, a meta cut short, emptied, of a newer elche or missing a key was
refused without saying which file (``resume_from: meta file is not JSON:
Expecting value: line 1 column 1 (char 0)``), a folder where a bundle's file
should be raised ``IsADirectoryError`` from the hashing, and a
``resume_from`` that named the meta, a folder of bundles or a model file said
only ``no checkpoint meta at STEM.meta.json.meta.json``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

import elche
from elche.core.errors import ConfigError
from elche.runtime import bundle
from tests.promises.tiny import bundle_on_disk, make_model, make_optimizer, step

DATA = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder holding bundle ``run`` of a one-rank run after its epoch."""
    folder = tmp_path_factory.mktemp("saved")
    result = elche.train(
        make_model, make_optimizer, step, DATA, batch_size=8, epochs=1, ranks=1,
        progress=False, save_path=str(folder / "run"), checkpoint_every=1,
    )  # fmt: skip
    assert result.summary["outcome"] == "completed"
    return folder


@pytest.fixture
def stem(saved: Path, tmp_path: Path) -> str:
    """A copy of the bundle, this test's to damage."""
    shutil.copytree(saved, tmp_path / "b")
    return str(tmp_path / "b" / "run")


def refused(resume_from: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        elche.train(
            make_model, make_optimizer, step, DATA, batch_size=8, epochs=2, ranks=1,
            progress=False, resume_from=resume_from,
        )  # fmt: skip
    return info.value


def meta_text(stem: str) -> str:
    return bundle.meta_path(stem).read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("damage", "field", "says"),
    [
        (lambda text: text[: len(text) // 2], "resume_from", "meta file is not JSON"),
        (lambda text: "", "resume_from", "meta file is not JSON"),
        (
            lambda text: text.replace('"schema_version": 5', '"schema_version": 99'),
            "resume_from",
            "meta schema 99 is newer",
        ),
        (
            lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "coverage"}),
            "coverage",
            "is missing from the meta",
        ),
    ],
    ids=["cut-short", "empty", "newer-schema", "key-missing"],
)
def test_a_damaged_meta_is_refused_naming_its_file(
    stem: str, damage: object, field: str, says: str
) -> None:
    where = bundle.meta_path(stem)
    where.write_text(damage(meta_text(stem)), encoding="utf-8")  # type: ignore[operator]
    error = refused(stem)
    assert error.field == field
    assert says in str(error)
    assert str(where) in str(error)


def test_a_folder_in_place_of_the_bundles_model_is_refused_naming_it(stem: str) -> None:
    model = bundle_on_disk(stem).model
    model.unlink()
    model.mkdir()
    error = refused(stem)
    assert error.field == "resume_from"
    assert f"cannot read the bundle's model {model}: Is a directory" in str(error)


def test_the_meta_itself_as_resume_from_names_the_stem_to_pass(stem: str) -> None:
    error = refused(str(bundle.meta_path(stem)))
    assert f"is the meta itself; pass its bundle's stem, resume_from={stem!r}" in str(error)


@pytest.mark.parametrize("form", ["{}", "{}/"])
def test_a_folder_as_resume_from_names_the_bundle_inside_it(stem: str, form: str) -> None:
    folder = form.format(Path(stem).parent)
    error = refused(folder)
    assert f"{folder!r} is a folder" in str(error)
    assert f"name the bundle inside it, e.g. {stem!r}" in str(error)


def test_a_model_file_as_resume_from_says_it_is_no_bundle(stem: str) -> None:
    model = str(bundle_on_disk(stem).model)
    error = refused(model)
    assert f"{model!r} is a file, not a bundle's stem" in str(error)
    assert "a run's final model is no bundle" in str(error)
