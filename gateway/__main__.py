"""``python -m gateway``: run the gateway alone (flags and DARTREE_* variables as ``dartree gateway``)."""

import argparse
import sys

from services.serve import add_gateway_args, gateway_main

parser = argparse.ArgumentParser(prog="python -m gateway", description="DARTree Serve HTTP gateway")
add_gateway_args(parser)
sys.exit(gateway_main(parser.parse_args()))
