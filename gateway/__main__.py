"""``python -m gateway``: run the gateway alone (flags and DARTREE_* variables as ``dartree gateway``)."""

import sys

from gateway.config import GatewayConfig
from gateway.server import run_gateway
from services.command_line import Parser, run_command
from services.config_cli import add_config_args, config_from_args

parser = Parser(prog="python -m gateway", description="DARTree Serve HTTP gateway")
add_config_args(parser, GatewayConfig)
sys.exit(run_command(lambda args: run_gateway(config_from_args(GatewayConfig, args)), parser.parse_args()))
