"""`import attnres` stays light: what only some paths need is imported on first use (benchmarks/import_time.py
measures the time against `import torch; from transformers import AutoModelForCausalLM`)."""

import json
import subprocess
import sys

# each of these takes from a tenth of a second to seconds to import, and only some paths need it
HEAVY = (
    "attnres.models.modeling_attnres",  # the model classes: transformers' modeling_utils
    "transformers.modeling_utils",
    "transformers.activations",  # transformers' kernel hub and DTensor
    "torch._dynamo",  # torch.compile
    "torch.distributed.tensor",
    "sympy",
    "scipy",
    "triton",
    "matplotlib",
    "safetensors",
    "attnres.training",
    "attnres.bench",
    "attnres.analysis",
)


def loaded_after(statement: str) -> list[str]:
    code = f"{statement}; import json, sys; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


def test_import_attnres_leaves_the_heavy_modules_for_later():
    loaded = set(loaded_after("import attnres"))
    assert "attnres.models.configuration_attnres" in loaded  # registered with the Auto classes
    assert [name for name in HEAVY if name in loaded] == []


def test_the_model_classes_load_on_first_use_through_the_auto_classes():
    code = (
        "import attnres, torch; from transformers import AutoModelForCausalLM; "
        "config = attnres.AttnResConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, "
        "num_attention_heads=4); model = AutoModelForCausalLM.from_config(config); "
        "assert type(model).__name__ == 'AttnResForCausalLM' and type(model) is attnres.AttnResForCausalLM"
    )
    assert "attnres.models.modeling_attnres" in loaded_after(code)


def test_generation_reads_run_folders_without_the_training_code():
    """The run folder's layout lives below both (`attnres.run_layout`): loading a run for generation needs no
    training module (its distributed and optimiser code)."""
    loaded = loaded_after("import attnres.inference")
    assert "attnres.run_layout" in loaded
    assert [name for name in loaded if name.startswith("attnres.training")] == []
