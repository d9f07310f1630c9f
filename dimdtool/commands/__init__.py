"""Click wrappers, one module per stage; the library modules never import click."""
