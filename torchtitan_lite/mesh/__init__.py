"""The parallel layout, below every layer that uses it: the degrees and device meshes (``parallel_dims``) and
the device and process-group helpers (``process_groups``). It imports only torch and the model shape it checks the
degrees against (protocols/model_shape.py), so the protocols, the components, the distributed mechanics and the
trainer all import it without a cycle."""
