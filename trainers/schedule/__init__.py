"""Data scheduling: the order in which upcoming train-units (batches) are trained on, chosen
from the live model (`scheduler`); D^3's directed-influence graph order (`d3`)."""
