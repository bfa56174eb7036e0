"""Issue 18, acceptance 2: the engine on the GPU with decode CUDA graphs (the default) on a tiny random
float32 Qwen3-MoE checkpoint (and Qwen2-MoE with its shared expert): greedy tokens equal HF transformers'
by the numerical-comparison policy, with batches padded up to a graph size and shrinking as requests end."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.gpu.test_engine_tiny_gpu import graph_decodes_vs_hf  # noqa: E402
from tests.model_executor.models.tiny_configs import MOE_VARIANTS, tiny_config  # noqa: E402
from tests.utils_model import make_tiny_hf_model  # noqa: E402


@pytest.mark.parametrize("variant", ["qwen3_moe", "qwen2_moe"])
def test_moe_graph_decodes_match_hf(variant: str, tmp_path) -> None:  # noqa: ANN001
    hf = make_tiny_hf_model(variant, tmp_path, config=tiny_config(MOE_VARIANTS, variant)).to("cuda")
    _, verdicts = graph_decodes_vs_hf(hf, str(tmp_path))
    print(variant, sum(v.diverged_at is None for v in verdicts), "of", len(verdicts), "identical")
