"""Presets that live in their own file: each module here is imported when ``var_core.accel.presets`` loads and
registers its preset with ``@preset`` (see ``docs/extending.md``). Outside the package, a preset file is a plugin
(``--plugins FILE``)."""
