"""Tools around Trainyard, not building blocks of it: the demo media generator and a local S3 server."""
