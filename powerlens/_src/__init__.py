"""powerlens's implementation. Nothing here is public: the API is what :mod:`powerlens`
re-exports (``pl.__all__``), and the command line is :mod:`powerlens.cli`."""
