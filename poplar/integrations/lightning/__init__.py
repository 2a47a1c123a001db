"""Lightning: ``PoplarStrategy`` (``Trainer(strategy=PoplarStrategy(...))`` or ``strategy="poplar"``)."""

from poplar.integrations.lightning.strategy import PoplarStrategy

__all__ = ["PoplarStrategy"]
