"""The engine every layer family's training step shares (docs/architecture.md). Imports nothing."""
