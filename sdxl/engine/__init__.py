"""The compiled program and its host side: requests, their arrays, the compiled stages, the pipeline that
renders them on a device mesh, and pictures in and out."""
