"""Model families. Importing this package registers each family's ``ModelSpec`` with the core
(``torchtitan_lite.protocols.model_spec``), which looks them up by ``model.name``."""
from __future__ import annotations

from models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3Model, DeepSeekV3ModelArgs
from models.deepseek_v3.attention_shape import deepseek_v3_attention_shape
from models.deepseek_v3.hf_args import deepseek_v3_args_from_hf
from models.deepseek_v3.kv_cache import DeepSeekV3KVCache
from models.deepseek_v3.parallelize import DEEPSEEK_V3_PARALLEL_PLAN, check_deepseek_v3_run
from models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
from models.llama3 import LLAMA3_FLAVORS, Llama3ModelArgs, Transformer
from models.llama3.kv_cache import Llama3KVCache
from models.llama3.parallelize import LLAMA3_PARALLEL_PLAN
from models.llama3.state_dict_adapter import Llama3StateDictAdapter
from models.qwen3_moe import QWEN3_MOE_FLAVORS, Qwen3MoeModel, Qwen3MoeModelArgs
from models.qwen3_moe.hf_args import qwen3_moe_args_from_hf
from models.qwen3_moe.kv_cache import Qwen3MoeKVCache
from models.qwen3_moe.parallelize import QWEN3_MOE_PARALLEL_PLAN, check_qwen3_moe_run
from models.qwen3_moe.state_dict_adapter import Qwen3MoeStateDictAdapter
from torchtitan_lite.protocols.model_spec import (
    ModelSpec,
    build_model_args,
    get_model_spec,
    model_specs,
    register_model_spec,
)

LLAMA3_SPEC = register_model_spec(ModelSpec(
    name="llama3",
    model_cls=Transformer,
    args_cls=Llama3ModelArgs,
    flavors=LLAMA3_FLAVORS,
    parallel_plan=LLAMA3_PARALLEL_PLAN,
    state_dict_adapter_cls=Llama3StateDictAdapter,
    kv_cache_cls=Llama3KVCache,
))

QWEN3_MOE_SPEC = register_model_spec(ModelSpec(
    name="qwen3_moe",
    model_cls=Qwen3MoeModel,
    args_cls=Qwen3MoeModelArgs,
    flavors=QWEN3_MOE_FLAVORS,
    parallel_plan=QWEN3_MOE_PARALLEL_PLAN,
    state_dict_adapter_cls=Qwen3MoeStateDictAdapter,
    kv_cache_cls=Qwen3MoeKVCache,
    moe_facts=Qwen3MoeModelArgs.moe_facts,
    check_run=check_qwen3_moe_run,
    args_from_hf=qwen3_moe_args_from_hf,
))

DEEPSEEK_V3_SPEC = register_model_spec(ModelSpec(
    name="deepseek_v3",
    model_cls=DeepSeekV3Model,
    args_cls=DeepSeekV3ModelArgs,
    flavors=DEEPSEEK_V3_FLAVORS,
    parallel_plan=DEEPSEEK_V3_PARALLEL_PLAN,
    state_dict_adapter_cls=DeepSeekV3StateDictAdapter,
    kv_cache_cls=DeepSeekV3KVCache,
    moe_facts=DeepSeekV3ModelArgs.moe_facts,
    check_run=check_deepseek_v3_run,
    args_from_hf=deepseek_v3_args_from_hf,
    attention_shape=deepseek_v3_attention_shape,
))

MODEL_SPECS: dict[str, ModelSpec] = model_specs()

__all__ = ["DEEPSEEK_V3_SPEC", "LLAMA3_SPEC", "QWEN3_MOE_SPEC", "MODEL_SPECS", "ModelSpec", "build_model_args", "get_model_spec"]
