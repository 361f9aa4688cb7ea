"""Benchmarks, one module per problem family: each measures and returns rows (cs336_systems.rows). The
reports module of the same name renders them and answers the family's written questions from them
(cs336_systems.reports.problems lists them all)."""
