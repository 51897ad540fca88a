"""The IPython magics, thin shells over the API: ``%gpu``, ``%%launch_ddp``, ``%ddp``/``%%ddp``, ``%%launch_bg``
and ``%jobs``, sharing one parser kit (``parsing``)."""
