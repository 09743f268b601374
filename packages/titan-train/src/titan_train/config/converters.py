"""The names `model.converters` accepts: the one list that the schema, the migration of old names, the
refusals and the wiring read."""

from __future__ import annotations

FLOAT8 = "quantize.linear.float8"
MX = "quantize.linear.mx"
LORA = "lora"
CONVERTERS = (FLOAT8, MX, LORA)
# Old short names, migrated to the current ones with a warning (`titan_train.config.migrate`).
OLD_NAMES = {"float8": FLOAT8, "mx": MX}
FLOAT8_CONVERTERS = ("float8", FLOAT8)
MX_CONVERTERS = ("mx", MX)
QUANTISED_CONVERTERS = (*FLOAT8_CONVERTERS, *MX_CONVERTERS)
