"""Pure layer maps, attention modes, norms, ``simulate`` (lax.scan), synthetic systems, power iteration."""
from .params import LayerConfig, Layers, constant_term, layer_matrices, make_layers, value_matrix
from .layer import RULES, attention_output, faithful_rule, layer_step
from .attention import ATTENTION_MODES, attention_weights
from .simulate import Trajectory, pooled, simulate, simulate_batch
