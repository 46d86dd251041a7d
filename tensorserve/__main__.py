from tensorserve.cli import main
import sys
sys.exit(main())
