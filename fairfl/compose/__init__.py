"""Composition layer: the CLI, the local launcher, the in-process transport, compare and monitor. It wires the
services and the ground floor together and may import both; nothing below imports it."""
