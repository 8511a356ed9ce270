"""Argument types and up-front checks shared by the ``python -m studies.X`` entry points: library code, kept in
:mod:`var_core.cli_args` (the house plan: studies/ holds no logic a test would need) and re-exported here."""

from __future__ import annotations

from var_core.cli_args import (  # noqa: F401
    ACCELERATORS, ArgumentParser, MAX_SEED, PRECISION_HELP, STRATEGIES, accelerator, add_config_arguments,
    add_launch_arguments, at_least, check_args, check_devices, check_evaluation_args, class_conditional_model,
    device_setting, devices_setting, existing_path, finite_float, format_config, launch_banner, launch_precision,
    lightning_interrupts, model_family, model_name, non_negative_int, output_file, positive_int, parse_with_config,
    positive_float, precision_setting, preset_name, resolve_device, results_folder, seed_int, strategy_name,
    threads_setting, torch_device
)
