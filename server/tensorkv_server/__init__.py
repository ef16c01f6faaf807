"""tensorkv's parameter server: ``tensorkv-server --port 50051 --num-workers N --mode sync|async``."""
