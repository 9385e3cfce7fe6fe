"""FP8 quantization: the math and GEMMs (:mod:`.fp8`), the scheme of a model from
``--quantization`` and its checkpoint (:mod:`.config`), and the passes that give a built
model FP8 weights (:mod:`.apply`). Nothing is imported here, so that the layers can
import :mod:`.fp8` without an import circle."""
