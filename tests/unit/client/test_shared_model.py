"""Sites in one process share one read-only model; writing to it fails loudly."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import client.models.shared
from client.models import LoadedModel, load_model, save_tiny_model
from client.models.shared import (
    WeightGuard,
    check_shared_contents,
    clear_shared_models,
    model_key,
    shared_model,
    shared_model_count,
)
from client.release.site import Site, cached_model
from client.settings import SiteSettings
from dpmtv_common.errors import ConfigError, ModelError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("shared-tiny")
    save_tiny_model("llava", directory, seed=0)
    return directory


@pytest.fixture(autouse=True)
def fresh_cache() -> Iterator[None]:
    clear_shared_models()
    yield
    clear_shared_models()


@pytest.fixture
def load_counter(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    loads: list[Path] = []

    def counting(path: Path, **options: object) -> LoadedModel:
        loads.append(Path(path))
        return load_model(path, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(client.models.shared, "load_model", counting)
    return loads


def site_settings(tmp_path: Path, model_dir: Path, index: int, **extra: object) -> SiteSettings:
    return SiteSettings(
        name=f"site-{index}",
        model_path=model_dir,
        state_dir=tmp_path / f"site-{index}",
        device="cpu",
        **extra,  # type: ignore[arg-type]
    )


def first_parameter(loaded: LoadedModel) -> nn.Parameter:
    return next(loaded.model.parameters())


def test_ten_sites_of_one_model_load_it_once(
    tmp_path: Path, model_dir: Path, load_counter: list[Path]
) -> None:
    # Arrange: ten sites with their own state folders, one model folder
    sites = [Site(site_settings(tmp_path, model_dir, index)) for index in range(10)]

    # Act: each site takes its model twice, in turn
    models = [site.model() for _ in range(2) for site in sites]

    # Assert: one load, one object; the sites' own state stays their own
    assert len(load_counter) == 1
    assert shared_model_count() == 1
    assert all(model is models[0] for model in models)
    sites[0].seeds["r1"] = 7
    assert all("r1" not in site.seeds for site in sites[1:])


def test_another_dtype_is_another_model(
    tmp_path: Path, model_dir: Path, load_counter: list[Path]
) -> None:
    # Arrange
    float32 = site_settings(tmp_path, model_dir, 0)
    bfloat16 = site_settings(tmp_path, model_dir, 1, dtype="bfloat16")

    # Act
    first, second = cached_model(float32), cached_model(bfloat16)

    # Assert
    assert first is not second
    assert (first.dtype_name, second.dtype_name) == ("float32", "bfloat16")
    assert len(load_counter) == 2


def test_a_link_to_the_folder_is_the_same_model(
    tmp_path: Path, model_dir: Path, load_counter: list[Path]
) -> None:
    # Arrange
    link = tmp_path / "link"
    link.symlink_to(model_dir, target_is_directory=True)

    # Act
    direct = shared_model(model_dir, device="cpu")
    linked = shared_model(link, device="cpu")

    # Assert
    assert direct is linked
    assert load_counter == [model_dir.resolve()]


def test_a_folder_rewritten_in_place_is_loaded_again(tmp_path: Path) -> None:
    # Arrange
    folder = tmp_path / "model"
    save_tiny_model("llava", folder, seed=0)
    before = shared_model(folder, device="cpu")

    # Act: another model saved over the same folder
    save_tiny_model("llava", folder, seed=1)
    after = shared_model(folder, device="cpu")

    # Assert
    assert after is not before
    assert after.fingerprint != before.fingerprint


def test_shared_weights_do_not_require_grad(model_dir: Path) -> None:
    # Act
    loaded = shared_model(model_dir, device="cpu")

    # Assert
    assert not any(parameter.requires_grad for parameter in loaded.model.parameters())


@pytest.mark.parametrize(
    "write",
    [
        pytest.param(lambda p: p.add_(1.0), id="add_"),
        pytest.param(lambda p: p.__setitem__(0, 0.5), id="setitem"),
        pytest.param(lambda p: p.detach().mul_(2.0), id="through-detach"),
        pytest.param(lambda p: p.view(-1)[:1].zero_(), id="through-a-view"),
        pytest.param(lambda p: p.copy_(torch.zeros_like(p)), id="copy_"),
    ],
)
def test_an_in_place_write_fails_the_next_hand_out(model_dir: Path, write) -> None:
    # Arrange
    loaded = shared_model(model_dir, device="cpu")

    # Act: a site writes to the shared weights
    with torch.no_grad():
        write(first_parameter(loaded))

    # Assert: no other site computes on them
    with pytest.raises(ModelError, match="shared model weights must stay as loaded"):
        shared_model(model_dir, device="cpu")


def test_a_replaced_parameter_fails_the_next_hand_out(model_dir: Path) -> None:
    # Arrange
    loaded = shared_model(model_dir, device="cpu")
    name, parameter = next(loaded.model.named_parameters())
    owner_name, _, attribute = name.rpartition(".")
    owner = loaded.model.get_submodule(owner_name)

    # Act
    setattr(owner, attribute, nn.Parameter(parameter.detach().clone(), requires_grad=False))

    # Assert
    with pytest.raises(ModelError, match="was replaced"):
        shared_model(model_dir, device="cpu")


def test_a_parameter_made_trainable_fails_the_next_hand_out(model_dir: Path) -> None:
    # Arrange
    loaded = shared_model(model_dir, device="cpu")

    # Act
    first_parameter(loaded).requires_grad_(True)

    # Assert
    with pytest.raises(ModelError, match="requires_grad=True"):
        shared_model(model_dir, device="cpu")


def test_a_write_through_data_is_caught_by_the_contents_check(model_dir: Path) -> None:
    # Arrange: .data bypasses torch's version counter, so the cheap check cannot see it
    loaded = shared_model(model_dir, device="cpu")
    check_shared_contents()  # as loaded

    # Act
    first_parameter(loaded).data.add_(1.0)

    # Assert
    shared_model(model_dir, device="cpu")
    with pytest.raises(ModelError, match="bytes differ"):
        check_shared_contents()


def test_a_forward_pass_and_its_hooks_leave_the_guard_quiet(model_dir: Path) -> None:
    # Arrange
    loaded = shared_model(model_dir, device="cpu")
    guard = WeightGuard(loaded.model)
    ids = torch.zeros((1, 4), dtype=torch.long)

    # Act
    with torch.no_grad():
        loaded.model.get_decoder()(input_ids=ids)

    # Assert
    guard.check_contents()


def test_model_key_refuses_a_missing_folder(tmp_path: Path) -> None:
    # Act / Assert
    with pytest.raises(ConfigError, match="path must be an existing model directory"):
        model_key(tmp_path / "absent", device="cpu")


def test_model_key_names_the_resolved_folder_device_and_dtype(model_dir: Path) -> None:
    # Act
    key = model_key(model_dir, device="cpu", dtype="bfloat16")

    # Assert
    assert (key.folder, key.device, key.dtype) == (model_dir.resolve(), "cpu", "bfloat16")
    assert {name for name, *_ in key.files} == set(os.listdir(model_dir))


def test_the_contents_check_of_a_bfloat16_model_sees_a_write_through_data(model_dir: Path) -> None:
    # Arrange: two bytes an element, hashed as they are stored
    loaded = shared_model(model_dir, device="cpu", dtype="bfloat16")
    check_shared_contents()

    # Act
    first_parameter(loaded).data.mul_(2.0)

    # Assert
    with pytest.raises(ModelError, match="bytes differ"):
        check_shared_contents()
