import pytest

from remote_drafter.models.dspark import DSparkConfig, DSparkModel, init_weights
from remote_drafter.models.llama import LlamaConfig, random_llama

LAYERS = (0, 1, 3)


@pytest.fixture(scope="session")
def tiny_target():
    config = LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=128)
    return random_llama(config, seed=1)


@pytest.fixture(scope="session")
def tiny_drafter(tiny_target):
    c = DSparkConfig(vocab_size=512, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                     intermediate_size=128, window=16, target_layers=list(LAYERS), target_hidden_size=64,
                     mask_token_id=511)
    return init_weights(DSparkModel(c, tiny_target.model.embed_tokens.weight.detach(),
                                    tiny_target.head_weight.detach()), seed=0, std=0.05)
