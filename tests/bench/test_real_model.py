"""benchmarks/real_model.py's models: the conversions read the original's own weight memory and still compute its
function; the copy keeps weights of its own."""

import torch

from benchmarks import real_model


def test_conversions_share_the_originals_weights_and_compute_its_logits():
    models = real_model.load_models(real_model.SMOKE, torch.float32, "cpu", 2, family_norms=False)
    original = models[real_model.ORIGINAL]
    weights = {name: p.data_ptr() for name, p in original.named_parameters(remove_duplicate=False)}
    for name in (real_model.STANDARD, real_model.BLOCK, real_model.FULL):
        own = dict(models[name].named_parameters(remove_duplicate=False))
        assert {k: own[k].data_ptr() for k in weights} == weights, name
        assert any("_res_" in k for k in own) == (name != real_model.STANDARD)
    copied = dict(models[real_model.COPY].named_parameters())
    assert all(copied[k].data_ptr() != ptr for k, ptr in weights.items() if k in copied)

    ids = torch.randint(0, real_model.SMOKE["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = original(ids).logits
        for name in (real_model.STANDARD, real_model.BLOCK, real_model.FULL):
            torch.testing.assert_close(models[name](ids).logits, expected, rtol=1e-5, atol=1e-5)
