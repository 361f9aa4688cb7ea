"""Closed-form models, one module per subject; units are in the names (bytes, flops, seconds).

flops: matmul FLOPs of the LM. Other modules model memory, communication and parallelism;
communication_accounting and parallelism_calcs evaluate them into the rows of the problems answered in closed form.
"""
