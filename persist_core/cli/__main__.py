from persist_core.cli import main

main()
