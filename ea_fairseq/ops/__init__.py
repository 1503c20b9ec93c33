"""The contracts of the plugin's operations: what an operation takes and returns, and which
of its backends runs a call. Nothing here imports an ``nn.Module``, so a backend (the
PyTorch reference in :mod:`ea_fairseq.modules`, an accelerator in
:mod:`ea_fairseq.accelerators`) imports these modules and nothing of its callers."""
