"""Benchmarks, one module per problem family: each measures and returns rows, renders its reports and
answers its problems' written questions from those rows (cs336_systems.reports.problems lists them all)."""
