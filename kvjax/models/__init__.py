"""Model families (kvjax.models.family) and the decoder they share. Importing this package registers every family."""

from kvjax.models import qwen3  # noqa: F401  (registers the Qwen3 family)
from kvjax.models import qwen3_moe  # noqa: F401  (registers the Qwen3-MoE family)
from kvjax.models import llama  # noqa: F401  (registers the Llama family)
