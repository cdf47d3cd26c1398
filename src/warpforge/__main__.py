from warpforge.cli import main

main()
