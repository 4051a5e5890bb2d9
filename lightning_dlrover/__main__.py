from lightning_dlrover.cli import main

main()
