"""NVIDIA ModelOpt exports."""

from conversion_fixtures import modelopt_fixture
from hf_eagle3.conversion import convert
from safetensors.torch import save_file


def test_older_modelopt_export_with_midlayer_names_is_still_modelopt(tmp_path):
    fixture = modelopt_fixture(tmp_path)
    save_file(
        {name.replace("layers.0.", "midlayer."): tensor for name, tensor in fixture.tensors.items()},
        tmp_path / "model.safetensors",
    )
    checkpoint, detected = convert(tmp_path, tmp_path / "hub")
    assert detected == "modelopt" and checkpoint.config.target_layer_ids == [2, 6, 9]
