"""lorafleet: multi-tenant LoRA inference on Kubernetes."""

__version__ = "0.1.0"
