from poplar.models.tiny import TinyCausalLM, causal_lm_loss

__all__ = ["TinyCausalLM", "causal_lm_loss"]
